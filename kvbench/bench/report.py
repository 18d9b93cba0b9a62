"""The report of ``kvbench bench``: the targets the figures are held to, where they were measured, and
``bench.md``'s figures (its tables: :mod:`kvbench.bench.markdown`)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
import transformers

from kvbench.models import LoadedModel
from kvbench.policies import build_policy, parse_spec

#: prefill overhead at the longest prompt (÷ full prefill): window-scored policies score only the observation
#: window, so eviction should cost at most 5 %; OBCache's key/joint terms add a GEMM over the window (10 %)
WINDOW_SCORING_LIMIT, WINDOW_OBCACHE_LIMIT = 1.05, 1.10
#: accumulating policies (H2O) score every query, by device: (alone, with OBCache's value term, with its key or joint
#: terms). One extra Q·Kᵀ pass; OBCache's key and joint terms add a GEMM of the outputs. On a GPU at 32k attention is
#: about half the prefill, so the pass costs more of it (``engine.sums_kernel=triton``: the fused sums)
EVERY_QUERY_LIMITS = {"cpu": (1.10, 1.5, 1.5), "cuda": (1.3, 1.5, 1.8)}
#: decode latency per token at the budget, longest ÷ shortest prompt: flat when the cache is bounded
FLAT_DECODE_LIMIT = 1.15
#: kvbench's full-cache tokens/s ÷ ``model.generate``'s, and kvpress SnapKV's time ÷ kvbench's: at least
HARNESS_SPEED_FLOOR, KVPRESS_SPEED_FLOOR = 0.95, 1.0
#: a grid's jobs as one grouped sweep sharing its prefills and decoding its rows together, end to end, against one
#: ``kvbench run`` process each decoding one sample at a time
GRID_SPEED_FLOOR = 11.0
#: decode tokens/s of ``bench.grid.rows`` rows decoding together against the same rows one at a time
ROWS_SPEED_FLOOR = 8.0
#: what the stored rows' shelves hold at their largest against the bytes the rows then reserve (kept and to come)
STORE_SPARE_LIMIT = 1.15
#: a sample's cost to the leaderboard's grid (every job of its experiment, one grouped sweep) against its full-cache
#: job's on the same samples, by the device its jobs ran on
LEADERBOARD_GRID_LIMIT = {"cpu": 6.0, "cuda": 3.0}


def prefill_limit(spec: str, device: str = "cpu") -> float:
    """The prefill-overhead limit of policy ``spec`` on a ``device`` type: by whether it scores every query and
    which of OBCache's terms are added."""
    _, modifiers = parse_spec(spec)
    obcache = {name for name in modifiers if name.startswith("obcache_")}
    if build_policy(spec).running:
        alone, value, joint = EVERY_QUERY_LIMITS["cuda" if device == "cuda" else "cpu"]
        return joint if obcache - {"obcache_value"} else value if obcache else alone
    return WINDOW_OBCACHE_LIMIT if obcache - {"obcache_value"} else WINDOW_SCORING_LIMIT


def targets(results: dict[str, Any], device: str = "cpu") -> dict[str, dict[str, Any]]:
    """The targets above against the figures measured on a ``device`` type: ``{name: {value, limit, met}}``."""
    found: dict[str, dict[str, Any]] = {}

    def check(name: str, value: float | None, limit: float, at_most: bool = True) -> None:
        if value is not None:
            found[name] = {"value": value, "limit": limit, "met": value <= limit if at_most else value >= limit}

    for spec, by_length in results["prefill_overhead"].items():
        longest = max(by_length, key=int)
        check(f"prefill_overhead[{spec}]@{longest}", by_length[longest], prefill_limit(spec, device))
    check("decode_latency_ratio", results["decode_latency_ratio"], FLAT_DECODE_LIMIT)
    check("harness_vs_generate", results["harness_vs_generate"], HARNESS_SPEED_FLOOR, at_most=False)
    check("kvpress_speed_ratio", results.get("kvpress", {}).get("speed_ratio"), KVPRESS_SPEED_FLOOR, at_most=False)
    check("grid_speed_ratio", results.get("grid", {}).get("speed_ratio"), GRID_SPEED_FLOOR, at_most=False)
    rows = results.get("grid", {}).get("rows", {}).get("speed_ratio")
    check("rows_decode_speed_ratio", rows, ROWS_SPEED_FLOOR, at_most=False)
    if (stored := results.get("grid", {}).get("rows", {})).get("stored_reserved_bytes"):
        check("stored_rows_spare", stored["stored_peak_bytes"] / stored["stored_reserved_bytes"], STORE_SPARE_LIMIT)
    if "leaderboard_grid" in results:
        board = results["leaderboard_grid"]
        check("leaderboard_grid_sample_cost_ratio", board["sample_cost_ratio"], LEADERBOARD_GRID_LIMIT[board["device"]])
    return found


def machine(loaded: LoadedModel) -> dict[str, Any]:
    """Where the figures were measured."""
    device = loaded.device
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "attn_backend": loaded.attn_backend,
    }
