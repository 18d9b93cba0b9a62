"""CPU threads that hold up on a shared machine (``engine.threads``).

torch's OpenMP threads wait for one another at the end of each parallel region. By default they wait by spinning, so
when another process holds a core, the thread that shares it with that process stalls every region and the spinning ones
burn the time it needs: a run beside a one-core load took 2.6× its time alone on 2 cores. Sleeping at once costs a
wake-up at every region instead, which the many small calls of a rows decode (each row's own attention, per layer) pay
thousands of times a step. kvbench sets ``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=1000`` (GNU OpenMP spins that
many times, about 10 µs, before sleeping) before torch loads its OpenMP runtime (the CLI,
:func:`kvbench.process.prepare`; values already in the environment win), and sizes torch's pool to the CPUs this process
may use (its affinity: what a Slurm allocation or ``taskset`` grants, not the machine's count).
"""

from __future__ import annotations

import os

import torch

from kvbench.domains import Domain, is_int

#: ``engine.threads``: ``auto`` (the CPUs this process may use) or a thread count
THREADS = Domain("auto or a thread count ≥ 1", lambda value: value == "auto" or (is_int(value) and value >= 1))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(setting: int | str) -> int:
    """Size torch's intra-op pool by ``engine.threads``; returns the count."""
    count = usable_cpus() if setting == "auto" else int(setting)
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
