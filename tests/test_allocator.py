"""glibc's malloc keeps large freed blocks for the next (kvbench/allocator.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvbench.allocator import _libc, keep_freed_memory, release_freed_memory

STATUS = Path("/proc/self/status")
pytestmark = pytest.mark.skipif(_libc() is None or not STATUS.exists(), reason="no glibc mallopt or /proc")


def resident() -> int:
    """This process's resident bytes (VmRSS)."""
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_large_freed_block_stays_resident_until_the_heap_is_handed_back():
    """With kvbench's thresholds a freed 28 MB block (a whole-prompt window's float32 map at 885 tokens) stays in the
    heap for the next one (glibc's defaults unmap it at once); :func:`release_freed_memory` hands it back."""
    assert keep_freed_memory()
    release_freed_memory()
    before = resident()
    block = np.ones(7_000_000, dtype=np.float32)
    del block
    kept = resident()
    assert kept - before > 20 * 2**20
    release_freed_memory()
    assert kept - resident() > 20 * 2**20
