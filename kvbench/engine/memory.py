"""How much memory new tensors may take: the accelerator's free memory, or on the host the available memory within
the process's memory cgroup (a Slurm job's or a container's limit), for ``engine.batch_size=auto``."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

#: where the cgroup hierarchies are mounted, and where the process reads its own cgroups
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: a cgroup's (limit, usage) files: cgroup v2 (the unified hierarchy), v1 (the memory controller's own)
V2_FILES, V1_FILES = ("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
NO_LIMIT = 1 << 60  # v1 writes "no limit" as a huge page-aligned number


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the accelerator's free memory, or the host's available memory, less
    where the process's memory cgroup admits less (:func:`cgroup_headroom`)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = psutil.virtual_memory().available
    headroom = cgroup_headroom()
    return available if headroom is None else max(0, min(available, headroom))


def cgroup_headroom() -> int | None:
    """What the process's memory cgroups still admit — limit less usage, the tightest over its cgroup and the cgroups
    above it, v2 or v1 — or None where none sets a limit (or cgroups cannot be read)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    headroom: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount, files = CGROUP_ROOT, V2_FILES
        elif "memory" in controllers.split(","):
            mount, files = CGROUP_ROOT / "memory", V1_FILES
        else:
            continue
        folder = mount / path.lstrip("/")
        for directory in [folder, *folder.parents]:
            limit, usage = (_read_bytes(directory / name) for name in files)
            if limit is not None and usage is not None and limit < NO_LIMIT:
                headroom = limit - usage if headroom is None else min(headroom, limit - usage)
            if directory == mount:
                break
    return headroom


def _read_bytes(path: Path) -> int | None:
    """The number in a cgroup file, or None (absent, unreadable, or ``max``)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
