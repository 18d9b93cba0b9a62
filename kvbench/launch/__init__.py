"""Orchestration: sweeps (expanded, checked and submitted by the kvbench sweeper) and the submitit launchers."""
