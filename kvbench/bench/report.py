"""The report of ``kvbench bench``: the targets the figures are held to, where they were measured, and
``bench.md`` (the figures of ``bench.json`` as Markdown tables)."""

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


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def markdown(results: dict[str, Any]) -> str:
    """``bench.md``: the figures of ``bench.json`` as Markdown tables."""
    info, config = results["machine"], results["config"]
    lines = [
        f"# kvbench bench — {info['model']} ({info['dtype']}, {info['attn_backend']}) on {info['device']}",
        "",
        (
            f"{info['platform']}, {info['cpu_count']} CPUs ({info['torch_threads']} torch threads), torch "
            f"{info['torch']}, transformers {info['transformers']}; load average at the end {info['load_average']}. "
            f"Budget {config['budget']['spec']}, regime {config['engine']['regime']}, "
            f"{config['bench']['repetitions']} repetitions (medians), prompts: {results['prompt_source']}; "
            f"{results['elapsed_seconds']:.0f} s."
        ),
    ]
    overhead, cpu = results["prefill_overhead"], results["prefill_overhead_cpu"]
    if overhead:
        lengths = list(next(iter(overhead.values())))
        full = results["raw"]["prefill"]["full"]
        lines += ["", "## Prefill with scoring + eviction ÷ full-cache prefill (wall; CPU time in brackets)", ""]
        rows = [
            [
                "full (seconds)",
                *(f"{full[n]['median_wall_seconds']:.2f} ({full[n]['median_cpu_seconds']:.2f})" for n in lengths),
            ]
        ]
        rows += [
            [spec, *(f"{ratios[n]:.3f} ({cpu[spec][n]:.3f})" for n in lengths)] for spec, ratios in overhead.items()
        ]
        lines += _table(["policy", *(f"{n} tokens" for n in lengths)], rows)
    if results.get("prefill_operators"):
        counts = results["prefill_operators"]
        lines += ["", f"## Operators a prefill of {counts['prompt_length']} tokens dispatches", ""]
        rows = [
            [spec, row["operators"], f"{row['ratio']:.2f}", row["host_reads"]]
            for spec, row in counts["by_policy"].items()
        ]
        lines += _table(["policy", "operators", "÷ full's", "values read back by the host"], rows)
    if results.get("prefill_profile"):
        profiles = results["prefill_profile"]
        for spec, profile in profiles["by_policy"].items():
            lines += [
                "",
                f"## Where {spec}'s prefill of {profiles['prompt_length']} tokens goes ({profile['clock']} time, "
                f"{profile['total_seconds']:.3f} s in all)",
                "",
            ]
            rows = [
                [row["name"][:90].replace("|", "/"), row["calls"], f"{row['seconds']:.4f}", f"{row['share']:.1%}"]
                for row in profile["top"]
            ]
            lines += _table(
                ["kernel" if profile["clock"] == "device" else "operator", "calls", "seconds", "share"], rows
            )
    if results["kv_bytes"]:
        lines += ["", "## KV-cache bytes at the longest prefill prompt (MiB)", ""]
        rows = []
        for spec, by_length in results["kv_bytes"].items():
            longest = max(by_length, key=int)
            row = by_length[longest]
            rows.append(
                [
                    spec,
                    longest,
                    _mib(row["after_prefill_bytes"]),
                    _mib(row["peak_bytes"]),
                    _mib(row["full_bytes"]),
                    f"{row['after_prefill_ratio']:.3f}",
                ]
            )
        lines += _table(["policy", "prompt", "after prefill", "peak", "full cache", "after/full"], rows)
    decode = results["raw"].get("decode")
    if decode:
        lines += [
            "",
            f"## Decode latency per token, {decode['policy']} at budget {decode['budget']} ({decode['regime']})",
            "",
        ]
        rows = [
            [n, f"{row['median_wall_seconds'] * 1000:.2f}", f"{row['median_cpu_seconds'] * 1000:.2f}"]
            for n, row in decode["per_token_seconds"].items()
        ]
        lines += _table(["prompt", "ms/token (wall)", "CPU ms/token"], rows)
        lines += [
            "",
            f"longest / shortest: **{results['decode_latency_ratio']:.3f}** (CPU time: {decode['ratio_cpu']:.3f})",
        ]
    memory = results["memory"]
    if memory:
        lines += ["", f"## Memory, {memory['regime']} regime ({memory['method']}; MiB)", ""]
        cuda = all("cuda_peak_bytes" in row for rows in memory["policies"].values() for row in rows.values())
        header = ["policy", "prompt", "peak RSS", "peak RSS − before", "KV peak", "full KV"]
        header += ["CUDA peak", "CUDA peak − before"] if cuda else []
        rows = []
        for spec, by_length in memory["policies"].items():
            for n, row in by_length.items():
                rows.append(
                    [
                        spec,
                        n,
                        _mib(row["peak_rss_bytes"]),
                        _mib(row["peak_rss_delta_bytes"]),
                        _mib(row["peak_bytes"]),
                        _mib(row["full_bytes"]),
                    ]
                )
                rows[-1] += [_mib(row["cuda_peak_bytes"]), _mib(row["cuda_peak_delta_bytes"])] if cuda else []
        lines += _table(header, rows)
        growth = ", ".join(
            f"{spec} ×{row['peak_rss_delta_bytes']:.2f}, {_mib(row['peak_rss_added_bytes'])} MiB more"
            f" (KV peak ×{row['peak_bytes']:.2f})"
            for spec, row in memory["growth"].items()
        )
        lines += ["", f"growth from the shortest to the longest prompt, peak RSS − before: {growth}"]
        if cuda:
            growth = ", ".join(
                f"{spec} ×{row['cuda_peak_delta_bytes']:.2f}, {_mib(row['cuda_peak_added_bytes'])} MiB more"
                for spec, row in memory["growth"].items()
            )
            lines += ["", f"growth of the CUDA peak − before: {growth}"]
    if "headwise" in results:
        headwise = results["headwise"]
        held = results["raw"]["headwise"]["held"]
        reference = headwise["reference"]
        lines += [
            "",
            f"## A length per head vs {reference} per layer ({headwise['prompt_length']}-token prompt, budget "
            f"{headwise['budget']})",
            "",
        ]
        rows = [
            [
                spec,
                _mib(held[spec]["after_prefill_bytes"]),
                f"{row['kv_bytes_ratio']:.3f}",
                f"{row['padded_bytes_ratio']:.3f}",
                f"{row['decode_ratio']:.3f}",
                f"{row['decode_ratio_cpu']:.3f}",
            ]
            for spec, row in headwise.items()
            if isinstance(row, dict)
        ]
        header = ["policy", "KV MiB after prefill", "KV ÷ reference", "padded to the longest head ÷ reference"]
        lines += _table([*header, "decode per token ÷ reference", "(CPU time)"], rows)
    generate = results["raw"].get("generate")
    if generate:
        lines += ["", f"## kvbench full cache vs model.generate ({generate['new_tokens']} new tokens, seconds)", ""]
        rows = [
            [
                n,
                f"{row['kvbench']['median_wall_seconds']:.2f}",
                f"{row['generate']['median_wall_seconds']:.2f}",
                f"{row['speed_ratio']:.3f}",
                f"{row['speed_ratio_cpu']:.3f}",
                generate["same_tokens"][n],
            ]
            for n, row in generate["per_prompt"].items()
        ]
        lines += _table(["prompt", "kvbench", "generate", "speed ratio", "speed ratio (CPU)", "same tokens"], rows)
        ratio = f"**{results['harness_vs_generate']:.3f}** (CPU time: {generate['speed_ratio_cpu']:.3f})"
        lines += ["", f"overall speed ratio (kvbench tokens/s ÷ generate tokens/s): {ratio}"]
    if "kvpress" in results:
        press = results["kvpress"]
        lines += ["", "## kvbench SnapKV vs kvpress SnapKVPress", ""]
        if "skipped" in press:
            lines.append(f"skipped: {press['skipped']}")
        else:
            lines += _table(
                ["kvpress", "prompt", "kept", "kvbench s", "kvpress s", "speed ratio", "Jaccard mean", "Jaccard min"],
                [
                    [
                        press["version"],
                        press["prompt_length"],
                        press["kept_tokens"],
                        f"{press['times']['kvbench']['median_wall_seconds']:.2f}",
                        f"{press['times']['kvpress']['median_wall_seconds']:.2f}",
                        f"{press['speed_ratio']:.3f}",
                        f"{press['jaccard_mean']:.4f}",
                        f"{press['jaccard_min']:.4f}",
                    ]
                ],
            )
    if "grid" in results:
        grid = results["grid"]
        lines += ["", f"## A grid of {grid['variants']} jobs × {grid['samples']} samples, end to end (seconds)", ""]
        lines += _table(
            ["one process per job", "one grouped sweep", "speed ratio", "same predictions"],
            [
                [
                    f"{grid['separate_seconds']:.1f}",
                    f"{grid['grouped_seconds']:.1f}",
                    f"{grid['speed_ratio']:.2f}",
                    grid["predictions_equal"],
                ]
            ],
        )
        memory = grid["memory"]
        lines += ["", "peak RSS − before, one prompt (MiB):", ""]
        lines += _table(
            ["one job", f"{memory['grouped']['variants']} variants, one prefill", "bound", "within"],
            [
                [
                    _mib(memory["one_job"]["peak_rss_delta_bytes"]),
                    _mib(memory["grouped"]["peak_rss_delta_bytes"]),
                    _mib(memory["bound_bytes"]),
                    memory["within_bound"],
                ]
            ],
        )
        decoding = grid["rows"]
        lines += ["", f"decode tokens/s, {decoding['policy']}, {decoding['new_tokens']} tokens per row:", ""]
        lines += _table(
            [
                "one row at a time",
                f"{decoding['rows']} rows together",
                "speed ratio",
                "same tokens",
                "padded: tokens/s",
                "padded: speed ratio",
                "padded: same tokens",
                "stored: tokens/s",
                "stored: speed ratio",
                "stored: same tokens",
                "stored: shelves ÷ reserved",
                "peak MiB",
                "caches MiB",
            ],
            [
                [
                    f"{decoding['one_row_tokens_per_second']:.1f}",
                    f"{decoding['rows_tokens_per_second']:.1f}",
                    f"{decoding['speed_ratio']:.2f}",
                    decoding["tokens_equal"],
                    *(
                        cell
                        for kind in ("padded", "stored")
                        for cell in (
                            f"{decoding[f'{kind}_rows_tokens_per_second']:.1f}",
                            f"{decoding[f'{kind}_speed_ratio']:.2f}",
                            decoding[f"{kind}_tokens_equal"],
                        )
                    ),
                    f"{decoding['stored_peak_bytes'] / max(decoding['stored_reserved_bytes'], 1):.3f}",
                    _mib(decoding["memory"]["peak_rss_delta_bytes"]),
                    _mib(decoding["memory"]["rows_cache_peak_bytes"]),
                ]
            ],
        )
    if "grid_operators" in results:
        counts = results["grid_operators"]
        lines += [
            "",
            f"## Operators of a grouped sample: {counts['rows']} rows of {counts['context_length']} tokens",
            "",
        ]
        full = counts["full_row"]["step_operators"]
        named = {"one full-cache row": counts["full_row"]}
        named.update((f"the rows, {attention}", figures) for attention, figures in counts["by_attention"].items())
        rows = [
            [
                name,
                figures["prefill_operators"],
                f"{figures['step_operators']:.0f}",
                f"{figures['step_operators'] / full:.1f}",
                f"{figures['step_host_reads']:.1f}",
                f"{figures['step_seconds']:.3f}",
            ]
            for name, figures in named.items()
        ]
        headers = ["", "prefill operators", "a step's operators", "÷ one row's", "a step's reads back", "a step (s)"]
        lines += _table(headers, rows) + ["", f"({counts['device']}; on a GPU each operator is a kernel launch)"]
    if "leaderboard_grid" in results:
        board = results["leaderboard_grid"]
        title = (
            f"## The {board['experiment']} grid: {board['jobs']} jobs × {board['samples']} samples, one grouped sweep"
            f" ({board['device']})"
        )
        lines += ["", title, ""]
        lines += _table(
            [
                "full-cache job alone (s)",
                "grid (s)",
                "cost ratio",
                "a sample: full job (s)",
                "a sample: grid (s)",
                "a sample's cost ratio",
                "predictions compared",
                "differing",
                "peak RSS: full job / grid (MiB)",
            ],
            [
                [
                    f"{board['full_seconds']:.1f}",
                    f"{board['grid_seconds']:.1f}",
                    f"{board['cost_ratio']:.1f}",
                    f"{board['full_sample_seconds']:.2f}",
                    f"{board['grid_sample_seconds']:.1f}",
                    f"{board['sample_cost_ratio']:.1f}",
                    board["predictions_compared"],
                    len(board["differing_predictions"]),
                    f"{_mib(board['full_peak_rss_bytes'])} / {_mib(board['grid_peak_rss_bytes'])}",
                ]
            ],
        )
        by_samples = board.get("grid_peak_rss_bytes_by_samples") or {}
        if by_samples:
            peaks = ", ".join(f"{count} samples {_mib(peak)}" for count, peak in by_samples.items())
            lines += ["", f"The grid's peak RSS (MiB) at other sample counts: {peaks}."]
    if "contexts" in results:
        shared = results["contexts"]
        lines += [
            "",
            f"## {shared['contexts']} contexts × {shared['questions'] // shared['contexts']} questions, "
            f"{shared['variants']} variants, query-agnostic (seconds)",
            "",
        ]
        lines += _table(
            ["compressed once per context", "once per question", "speed ratio", "compressions", "same predictions"],
            [
                [
                    f"{shared['once_per_context_seconds']:.1f}",
                    f"{shared['once_per_question_seconds']:.1f}",
                    f"{shared['speed_ratio']:.2f}",
                    f"{shared['compressions']['once_per_context']:.0f} vs "
                    f"{shared['compressions']['once_per_question']:.0f}",
                    shared["predictions_equal"],
                ]
            ],
        )
    if results["targets"]:
        lines += ["", "## Targets", ""]
        rows = [
            [name, f"{row['value']:.3f}", row["limit"], "yes" if row["met"] else "**no**"]
            for name, row in results["targets"].items()
        ]
        lines += _table(["figure", "measured", "limit", "met"], rows)
    return "\n".join(lines) + "\n"
