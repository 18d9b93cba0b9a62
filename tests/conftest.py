"""Test switches: ``RUN_SLOW=1`` also runs the ``slow`` tests that ``-m "not slow"`` deselects; ``model`` tests
are skipped, with the reason, when the offline SmolLM2 model cannot be obtained (no package registry)."""

from __future__ import annotations

import os
from functools import lru_cache

import pytest

import kvbench  # noqa: F401  sets OpenMP's wait before any test module imports torch (kvbench/engine/threads.py)


def interpret_kernels() -> None:
    """Without a CUDA device the Triton kernels (kvbench/kernels) run under Triton's interpreter, so that CI tests
    them; triton reads the switch when a kernel is defined, before any test module imports one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pin_worker() -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto``) each worker on a CPU of its own, before torch sizes its
    pool: the workers are the parallelism, and ``engine.threads=auto`` (the CPUs a process may use) gives each one
    thread, as a Slurm allocation of one CPU would."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(worker.removeprefix("gw")) % len(cpus)]})


pin_worker()
interpret_kernels()

TRUE = ("1", "true", "yes", "on")


def pytest_configure(config):
    if os.environ.get("RUN_SLOW", "").lower() in TRUE and config.option.markexpr.replace(" ", "") == "notslow":
        config.option.markexpr = ""


@lru_cache(maxsize=1)
def offline_model_problem() -> str | None:
    """Why the offline SmolLM2 cannot be loaded here, or None (it is then loaded once, for every test)."""
    from kvbench.errors import KVBenchError
    from kvbench.models import load_model, model_config

    try:
        load_model(model_config("smollm2_135m"))
    except KVBenchError as error:
        return str(error)
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("model") is not None:
        problem = offline_model_problem()
        if problem is not None:
            pytest.skip(f"the offline model smollm2_135m is not available: {problem}")


@pytest.fixture(autouse=True, scope="session")
def absl_handler_on_the_real_stderr():
    """absl (imported by rouge-score) builds its logging handler on the ``sys.stderr`` of the moment, which under
    pytest is the capture file, and closes that stream when Hydra's ``logging.config.dictConfig`` shuts every
    handler down (an in-process ``kvbench run``); pytest then fails on its own closed capture file."""
    import sys

    try:
        from absl import logging as absl_logging
    except ImportError:
        return
    absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__
