"""``kvbench plot RUN_DIR... --kind heatmap|budget|ppl|all``: the papers' figures from run directories.

* ``heatmap``  needle-in-a-haystack depth × context-length accuracy, one PNG per run whose records carry
  ``depth`` and ``context_length`` (the needle task's grid), in the Kamradt colours;
* ``budget``   score against KV budget, one line per policy (OBCache Fig. 3), one panel per model, task
  and context length, the full cache as a dashed line; ``--x ratio``: against the compression ratio instead (the
  share of the full cache's KV bytes evicted after the prefill, over the run's samples, as kvpress plots it);
  ``--x bytes``: against the KV bytes a sample held (:func:`held_mib`: every family on one axis — a quantised cache,
  a reading one that holds everything, an evicting one);
* ``ppl``      perplexity against token position (OBCache Fig. 4) from the perplexity records'
  ``buckets`` (bucket start → mean NLL), one line per policy and budget, one panel per model and text.

Files are written to ``--output-dir`` (default: the first RUN_DIR).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import pandas as pd  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvbench import file_name  # noqa: E402
from kvbench.budgets import Budget  # noqa: E402
from kvbench.errors import KVBenchError, choose  # noqa: E402
from kvbench.finished import Run, load_runs  # noqa: E402
from kvbench.results.table import budget_key, context_label, needle_records, policy_key, record_value  # noqa: E402

KAMRADT = LinearSegmentedColormap.from_list("kamradt", ["#F0496E", "#EBB839", "#0CD79F"])
"""Red → yellow → green, the colour map of Kamradt's needle-in-a-haystack heatmaps."""


def niah_grid(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Mean score (0–100) per depth (rows, %) and context length (columns, tokens)."""
    frame = pd.DataFrame(
        {
            "depth": [float(record_value(record, "depth")) for record in records],
            "context_length": [int(record_value(record, "context_length")) for record in records],
            "score": [100.0 * float(record["score"]) for record in records],
        }
    )
    return frame.pivot_table(index="depth", columns="context_length", values="score", aggfunc="mean").sort_index()


def niah_figure(records: list[dict[str, Any]], title: str) -> Figure:
    """The depth × context-length heatmap of one run's needle records."""
    grid = niah_grid(records)
    figure, axes = plt.subplots(figsize=(max(4.0, 0.6 * len(grid.columns) + 2), max(3.0, 0.3 * len(grid) + 1.5)))
    image = axes.imshow(grid.values, cmap=KAMRADT, vmin=0, vmax=100, aspect="auto")
    axes.set_xticks(range(len(grid.columns)), [context_label(int(c)) for c in grid.columns], rotation=45)
    axes.set_yticks(range(len(grid.index)), [f"{depth:g}" for depth in grid.index])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("needle depth (%)")
    axes.set_title(title)
    figure.colorbar(image, ax=axes, label="score")
    figure.tight_layout()
    return figure


def run_title(run: Run) -> str:
    return f"{run.metrics['model']} {run.label}"


def heatmaps(runs: list[Run], output_dir: Path) -> list[Path]:
    """One heatmap PNG per run with needle records."""
    paths = []
    for run in runs:
        records = needle_records(run)
        if records:
            figure = niah_figure(records, run_title(run))
            paths.append(save(figure, output_dir / file_name(f"heatmap_{run_title(run)}", ".png")))
    return paths


def budget_value(spec: str) -> tuple[str, float]:
    """A budget's axis and position: ``("KV budget (tokens)", 128)``, ``("KV budget (% of prompt)", 10)``,
    ``("KV budget (% of the full cache's bytes)", 25)`` or ``("KV budget (MiB)", 64)``."""
    budget = Budget.parse(spec)
    if budget.tokens is not None:
        return "KV budget (tokens)", budget.tokens
    if budget.fraction is not None:
        return "KV budget (% of prompt)", 100 * budget.fraction
    if budget.byte_fraction is not None:
        return "KV budget (% of the full cache's bytes)", 100 * budget.byte_fraction
    assert budget.byte_count is not None  # parse gives a budget one of its four forms
    return "KV budget (MiB)", budget.byte_count / 2**20


def compression_ratio(records: list[dict[str, Any]]) -> float | None:
    """The share of the full cache's KV bytes evicted after the prefill, over ``records`` (each ``kv``'s
    ``after_prefill_bytes`` and ``full_bytes``); None where no record says."""
    sizes = [
        record["kv"] for record in records if isinstance(record.get("kv"), dict) and record["kv"].get("full_bytes")
    ]
    if not sizes:
        return None
    return 1 - sum(kv["after_prefill_bytes"] for kv in sizes) / sum(kv["full_bytes"] for kv in sizes)


def held_mib(records: list[dict[str, Any]]) -> float | None:
    """The KV bytes a sample held, in MiB, the mean over ``records``: after the prefill, or the mean over the
    generation where the cache evicted while decoding (``kv.generation.mean_bytes``); None where no record says."""
    held = [
        kv["generation"]["mean_bytes"] if isinstance(kv.get("generation"), dict) else kv["after_prefill_bytes"]
        for kv in (record.get("kv") for record in records)
        if isinstance(kv, dict) and "after_prefill_bytes" in kv
    ]
    return sum(held) / len(held) / 2**20 if held else None


#: ``kvbench plot --x``: a budget curve's axis, the budget as the runs name it, the compression ratio or the bytes held
X_AXES = ("budget", "ratio", "bytes")
RATIO_AXIS = "compression ratio (KV evicted)"
BYTES_AXIS = "KV held per sample (MiB)"
MEASURED = {"ratio": (compression_ratio, RATIO_AXIS), "bytes": (held_mib, BYTES_AXIS)}


def budget_frame(runs: list[Run], x: str = "budget") -> pd.DataFrame:
    """One row per run and score shown: the run's average and, for RULER, each subtask; ``x="ratio"`` / ``"bytes"``:
    each with the run's :func:`compression_ratio` / :func:`held_mib` as ``ratio`` (a run without one left out)."""
    rows = []
    for run in runs:
        if "ppl" in run.metrics["scores"] or run.metrics.get("average") is None:
            continue
        ratio = MEASURED[x][0](run.records) if x in MEASURED else None
        if x in MEASURED and ratio is None:
            continue
        scores = dict(run.metrics["scores"])
        if len(scores) > 1:  # a panel for the run's overall score (the needle task's) or its average
            scores = {"average": scores.get("overall", run.metrics["average"])}
        for name, value in scores.items():
            rows.append(
                {
                    "model": run.metrics["model"],
                    "task": run.task,
                    "score": name,
                    "context": run.context,
                    "policy": run.table_identity()["policy"],
                    "budget": run.metrics["budget"],
                    "value": value,
                    "ratio": ratio,
                }
            )
    return pd.DataFrame(rows, columns=["model", "task", "score", "context", "policy", "budget", "value", "ratio"])


def budget_figure(frame: pd.DataFrame, x: str = "budget") -> Figure:
    """Score vs budget (``x="ratio"`` / ``"bytes"``: vs the compression ratio / the bytes held) per policy, a panel
    per (model, task, score, context, budget unit)."""
    frame = frame.copy()
    if x in MEASURED:
        frame["axis"], frame["x"] = MEASURED[x][1], frame["ratio"]
    else:
        frame[["axis", "x"]] = [budget_value(spec) for spec in frame["budget"]]
    panels = list(frame.groupby(["model", "task", "score", "context", "axis"], dropna=False, sort=True))
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.5 * rows), squeeze=False)
    for axis, ((model, task, score, context, unit), panel) in zip(axes.flat, panels):
        curves: dict[tuple[tuple[float, ...], tuple[float, ...]], list[str]] = {}
        for policy in sorted(panel["policy"].unique(), key=policy_key):
            line = panel[panel["policy"] == policy].sort_values("x")
            if policy == "full":
                axis.axhline(line["value"].iloc[0], color="black", linestyle="--", label="full")
            else:
                curves.setdefault((tuple(line["x"]), tuple(line["value"])), []).append(policy)
        for (budgets, values), policies in curves.items():  # identical curves drawn once, named together
            axis.plot(budgets, values, marker="o", label=" = ".join(policies))
        name = task if score == "average" else score
        axis.set_title(f"{model} {name}" + (f" @ {context_label(int(context))}" if pd.notna(context) else ""))
        axis.set_xlabel(unit)
        axis.set_ylabel("score")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.tight_layout()
    return figure


def budget_curves(runs: list[Run], output_dir: Path, x: str = "budget") -> list[Path]:
    frame = budget_frame(runs, x)
    if frame.empty:
        return []
    name = f"{x}_curves.png"
    return [save(budget_figure(frame, x), output_dir / name)]


def ppl_curve(run: Run) -> pd.Series:
    """Perplexity per position bucket (start token → exp of the mean NLL over the run's records)."""
    nlls: dict[int, list[float]] = {}
    for record in run.records:
        for start, nll in (record.get("buckets") or {}).items():
            nlls.setdefault(int(start), []).append(float(nll))
    return pd.Series({start: math.exp(sum(nll) / len(nll)) for start, nll in sorted(nlls.items())}, dtype=float)


def ppl_figure(runs: list[Run]) -> Figure:
    """PPL vs token position per policy@budget, one panel per (model, text)."""
    panels: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        panels.setdefault((run.metrics["model"], run.data), []).append(run)
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for axis, ((model, data), group) in zip(axes.flat, sorted(panels.items())):
        group = sorted(group, key=lambda run: (policy_key(run.metrics["policy"]), budget_key(run.metrics["budget"])))
        fulls = [run for run in group if run.metrics["policy"] == "full"]
        for run in fulls[:1] + [run for run in group if run not in fulls]:  # one full-cache line per panel
            curve = ppl_curve(run)
            full = run.metrics["policy"] == "full"
            axis.plot(
                curve.index,
                curve.values,
                label=run.label,
                marker="o",  # one point per bucket: the lines only join them
                markersize=3,
                color="black" if full else None,
                linestyle="--" if full else "-",
                zorder=3 if full else 2,
            )
        axis.set_title(f"{model} {data}")
        axis.set_xlabel("token position")
        axis.set_ylabel("perplexity")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def ppl_curves(runs: list[Run], output_dir: Path) -> list[Path]:
    runs = [run for run in runs if "ppl" in run.metrics["scores"]]
    if not runs:
        return []
    return [save(ppl_figure(runs), output_dir / "ppl_vs_length.png")]


def leaderboard_figure(cells: pd.DataFrame) -> Figure:
    """``kvbench leaderboard``'s cells as score (or perplexity) vs budget with their 95 % intervals drawn: a panel per
    (model, task, subtask, metric, context) and base policy, the base in black and each of its modifiers in colour,
    the full cache as a dashed line with its interval shaded."""
    frame = cells.copy()
    frame["base"] = [str(policy).split("+")[0] for policy in frame["policy"]]
    evicting = frame["base"] != "full"
    frame.loc[evicting, ["axis", "x"]] = [budget_value(spec) for spec in frame.loc[evicting, "budget"]]
    panels = [
        (key, cell[cell["base"] == "full"], base, group)
        for key, cell in frame.groupby(["model", "task", "subtask", "metric", "context"], dropna=False, sort=True)
        for base, group in cell[cell["base"] != "full"].groupby("base", sort=True)
    ]
    if not panels:
        raise KVBenchError("leaderboard plot: no cell of an evicting policy")
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.8 * rows), squeeze=False)
    for axis, ((model, task, subtask, metric, context), full, base, group) in zip(axes.flat, panels):
        if not full.empty:
            row = full.iloc[0]
            axis.axhline(row["mean"], color="grey", linestyle="--", label="full")
            axis.axhspan(row["low"], row["high"], color="grey", alpha=0.15)
        for policy in sorted(group["policy"].unique(), key=policy_key):
            line = group[group["policy"] == policy].sort_values("x")
            error = [line["mean"] - line["low"], line["high"] - line["mean"]]
            style = {"color": "black", "linewidth": 2} if policy == base else {}
            axis.errorbar(line["x"], line["mean"], yerr=error, marker="o", capsize=3, label=policy, **style)
        name = task if subtask == task else f"{task} {subtask}"
        axis.set_title(f"{base}: {model} {name}" + (f" @ {context_label(int(context))}" if pd.notna(context) else ""))
        axis.set_xlabel(group["axis"].iloc[0])
        axis.set_ylabel(f"{metric} (95% CI)")
        if metric == "score":
            axis.set_ylim(-5, 105)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="x-small", ncol=2)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.tight_layout()
    return figure


def save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


KINDS = {
    "heatmap": (heatmaps, "records with depth and context_length (the needle task)"),
    "budget": (budget_curves, "scored runs"),
    "ppl": (ppl_curves, "perplexity runs"),
}


def make_plots(runs: list[Run], kind: str, output_dir: Path, x: str = "budget") -> list[Path]:
    """Write the plots of ``kind`` (or ``all``: every kind with data), the budget curves against ``x``; a one-line
    error when there is none."""
    choose("plot kind", kind, ["all", *KINDS])
    choose("plot --x", x, X_AXES)
    paths = [
        path
        for name in (KINDS if kind == "all" else [kind])
        for path in (budget_curves(runs, output_dir, x) if name == "budget" else KINDS[name][0](runs, output_dir))
    ]
    if not paths:
        needs = "; ".join(f"{name} needs {what}" for name, (_, what) in KINDS.items() if kind in ("all", name))
        raise KVBenchError(f"nothing to plot for --kind {kind} in these runs: {needs}")
    return paths


def plot_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="kvbench plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories, or folders holding them")
    parser.add_argument("--kind", default="all", help="heatmap, budget, ppl or all (default)")
    parser.add_argument("--x", default="budget", help="the budget curves' axis: budget (default), ratio or bytes")
    parser.add_argument("--output-dir", type=Path, help="where to write the PNGs (default: the first RUN_DIR)")
    options = parser.parse_args(args)
    output_dir = options.output_dir or Path(options.run_dirs[0])
    for path in make_plots(load_runs(options.run_dirs), options.kind, output_dir, options.x):
        print(f"wrote {path}")


__all__ = ["compression_ratio", "held_mib", "leaderboard_figure", "make_plots", "niah_figure", "niah_grid", "ppl_curve"]
