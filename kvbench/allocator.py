"""glibc's malloc kept from handing large freed blocks back to the kernel (set as a kvbench process starts,
:func:`kvbench.process.prepare`).

Past its mmap threshold glibc serves an allocation with fresh pages from the kernel and unmaps them when freed, so
each large temporary tensor is page-faulted in, zero-filled, again: a VABS preference over a whole-prompt window
(float32 maps ``[B,Hq,W,T]`` of 28 MB at W = T = 885) took 12,700 page faults a call, none with both thresholds
raised. The mmap threshold goes to glibc's maximum on 64 bits (32 MiB) and the trim threshold to 1 GiB: freed memory
stays in the heap for the next tensor. Where memory is measured, :func:`release_freed_memory` hands it back first
(``kvbench.bench.measure.PeakMemory``). Without glibc (no ``mallopt``) nothing changes. A ``kvbench`` process that
``kvbench bench`` starts writes its own peak as it exits (:func:`write_own_peak`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64 bits: a larger value is refused
TRIM_THRESHOLD = 2**30


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; whether both were set."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the kernel (``malloc_trim(0)``), so that a measured peak counts what the
    block allocates, not what it reuses."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


#: where ``kvbench`` writes its own peak resident bytes as it exits (``VmHWM``, :func:`write_own_peak`), when set
PEAK_RSS_FILE = "KVBENCH_PEAK_RSS_FILE"


#: the kernel's account of this process's memory (Linux)
STATUS = Path("/proc/self/status")


def status_bytes(field: str) -> int | None:
    """A memory ``field`` of :data:`STATUS` (``VmRSS``, ``VmHWM``: kB there) in bytes; None without it."""
    if not STATUS.exists():
        return None
    found = [line.split()[1] for line in STATUS.read_text().splitlines() if line.startswith(field + ":")]
    return int(found[0]) * 1024 if found else None


def write_own_peak() -> None:
    """Write this process's peak resident bytes since its ``exec`` (``VmHWM``) to the file :data:`PEAK_RSS_FILE`
    names, if any."""
    if (target := os.environ.get(PEAK_RSS_FILE)) and (peak := status_bytes("VmHWM")) is not None:
        Path(target).write_text(str(peak))
