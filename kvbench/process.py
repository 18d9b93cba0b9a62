"""What a kvbench process sets before torch loads: OpenMP threads that wait by sleeping after a short spin
(:mod:`kvbench.engine.threads`) and glibc's malloc keeping large freed blocks (:mod:`kvbench.allocator`).

The CLI calls :func:`prepare` as it starts; a Python program calls it before it imports torch (after, only the
allocator's part takes effect). Importing kvbench sets nothing.
"""

from __future__ import annotations

import os
import sys

from kvbench.allocator import keep_freed_memory


def prepare() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=1000`` where torch has not loaded its OpenMP runtime yet
    (values already in the environment win), and glibc's thresholds raised."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    keep_freed_memory()
