"""``bench.md``: the figures of ``bench.json`` as Markdown tables, a section per part of the bench that ran (pandas
writes the tables)."""

from __future__ import annotations

from typing import Any

import pandas as pd


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table of ``rows`` under ``header`` (each cell's text, left-aligned), as its lines."""
    frame = pd.DataFrame([[str(cell) for cell in row] for row in rows], columns=header)
    return frame.to_markdown(index=False, disable_numparse=True).splitlines()


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def header(results: dict[str, Any]) -> list[str]:
    """The title and the machine, the settings and the prompts."""
    info, config = results["machine"], results["config"]
    return [
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


def prefill_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def operators_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if results.get("prefill_operators"):
        counts = results["prefill_operators"]
        lines += ["", f"## Operators a prefill of {counts['prompt_length']} tokens dispatches", ""]
        rows = [
            [spec, row["operators"], f"{row['ratio']:.2f}", row["host_reads"], row.get("host_copies", "")]
            for spec, row in counts["by_policy"].items()
        ]
        headers = ["policy", "operators", "÷ full's", "values read back by the host", "copies from the host"]
        lines += _table(headers, rows)
    return lines


def profile_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if results.get("prefill_profile"):
        profiles = results["prefill_profile"]
        for spec, profile in profiles["by_policy"].items():
            title = f"## Where {spec}'s prefill of {profiles['prompt_length']} tokens goes ({profile['clock']} time, "
            lines += ["", f"{title}{profile['total_seconds']:.3f} s in all)", "", *profile_table(profile)]
    return lines


def profile_table(profile: dict[str, Any], per: str = "") -> list[str]:
    """A profile's largest kernels (a GPU's) or operators: the calls, seconds and share of each (``per``: a step)."""
    rows = [[row["name"][:90].replace("|", "/"), f"{row['calls']:g}", f"{row['seconds']:.5f}", f"{row['share']:.1%}"]
            for row in profile["top"]]  # fmt: skip
    kind = "kernel" if profile["clock"] == "device" else "operator"
    return _table([kind, f"calls {per}".strip(), f"seconds {per}".strip(), "share"], rows)


def kv_bytes_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def decode_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def memory_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def headwise_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def generate_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def kvpress_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def grid_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def grid_operators_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "grid_operators" in results:
        counts = results["grid_operators"]
        title = f"## Operators of a grouped sample: {counts['rows']} rows of {counts['context_length']} tokens"
        lines += ["", title, ""]
        named = {"one full-cache row": counts["full_row"]}
        named.update((f"the rows, {attention}", figures) for attention, figures in counts["by_attention"].items())
        sample = {name: row["prefill_operators"] + row.get("decode_operators", 0) for name, row in named.items()}
        full = counts["full_row"]["step_operators"]
        rows = [
            [
                name,
                figures["prefill_operators"],
                figures.get("decode_operators", ""),
                f"{sample[name] / sample['one full-cache row']:.1f}",
                f"{figures['step_operators']:.0f}",
                f"{figures['step_operators'] / full:.1f}",
                f"{figures['step_host_reads']:.1f}",
                f"{figures['step_seconds']:.3f}",
            ]
            for name, figures in named.items()
        ]
        headers = ["", "prefill operators", "decode operators", "a sample's ÷ one row's", "a step's operators"]
        headers += ["÷ one row's", "a step's reads back", "a step (s)"]
        lines += _table(headers, rows) + ["", f"({counts['device']}; on a GPU each operator is a kernel launch)"]
        if profile := counts["by_attention"]["stored"].get("step_profile"):
            step = counts["by_attention"]["stored"]["step_seconds"]
            total = f"{profile['clock']} time: {profile['total_seconds']:.4f} s of the step's {step:.4f} s"
            lines += ["", f"### Where a step of the stored rows goes ({total})", "", *profile_table(profile, "a step")]
    return lines


def leaderboard_grid_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def contexts_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def targets_section(results: dict[str, Any]) -> list[str]:
    targets = results["targets"].items()
    rows = [[name, f"{row['value']:.3f}", row["limit"], "yes" if row["met"] else "**no**"] for name, row in targets]
    return ["", "## Targets", "", *_table(["figure", "measured", "limit", "met"], rows)] if rows else []


#: the sections of ``bench.md``, in order: each the lines of its figures in ``results`` (none where it was not run)
SECTIONS = (
    prefill_section,
    operators_section,
    profile_section,
    kv_bytes_section,
    decode_section,
    memory_section,
    headwise_section,
    generate_section,
    kvpress_section,
    grid_section,
    grid_operators_section,
    leaderboard_grid_section,
    contexts_section,
    targets_section,
)


def markdown(results: dict[str, Any]) -> str:
    """``bench.md``: the figures of ``bench.json`` as Markdown tables."""
    lines = header(results)
    for section in SECTIONS:
        lines += section(results)
    return "\n".join(lines) + "\n"
