"""Triton kernels (optional: ``triton`` ships with CUDA builds of torch; on CPU they run under its interpreter,
``TRITON_INTERPRET=1``, as the tests run them)."""

from __future__ import annotations

import functools
import os


@functools.cache
def available() -> bool:
    """Whether the kernels can run here (``triton`` imports: installed, and its libraries found)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs its kernels under its interpreter (``TRITON_INTERPRET=1``: on CPU, as the tests do)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
