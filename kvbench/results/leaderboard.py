"""``kvbench leaderboard``: every method's score per task and budget with its 95 % bootstrap interval over samples, and
each modifier against its base on the same samples (a paired bootstrap), so a table says where a difference is real.

A cell is one (model, task, subtask, metric, context, regime, policy, budget): the mean of its samples' scores (×100,
as the tables show them; a perplexity task's per-window perplexities as they are, lower is better) and its interval
(:func:`~kvbench.results.intervals.bootstrap_mean`), beside what a sample cost (the tokens it generated, the most its
cache held: :meth:`~kvbench.finished.Run.sample_costs`). A comparison pairs a ``base+modifier`` run with the ``base``
run of the same cell key and budget, over the sample ids both scored
(:func:`~kvbench.results.intervals.paired_difference`).

    kvbench leaderboard results/leaderboard [--baseline SPEC] [--format markdown|csv|latex] [--output-dir DIR]

``--baseline SPEC`` pairs every other policy with SPEC instead (a new method against SnapKV, say), the same way.

With ``--output-dir`` the tables are also written there, with ``leaderboard.png``: score vs budget per base and its
modifiers, intervals drawn (:func:`~kvbench.results.plots.leaderboard_figure`); with ``--provenance COMMAND``
(``make leaderboard`` passes it, ``--started``, the epoch second it started, and ``--commit``, the commit it ran) also
``provenance.json``: the command, its wall time, the kvbench commit, the library versions and the runs' and samples'
counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd

from kvbench.errors import KVBenchError, choose
from kvbench.finished import COST_NAMES, NO_BUDGET, Run, load_runs
from kvbench.results.intervals import bootstrap_mean, paired_difference
from kvbench.results.plots import leaderboard_figure, save
from kvbench.results.render import FORMATS, print_tables
from kvbench.results.table import budget_key, sort_rows

#: what makes two runs' samples comparable, beside the budget
CELL = ["model", "task", "subtask", "metric", "context", "regime"]


def task_label(run: Run) -> str:
    """The run's task, ``<task>-agnostic`` under ``task.query_mode=agnostic`` (its own cells: another protocol)."""
    return run.task if run.query_mode == "aware" else f"{run.task}-{run.query_mode}"


def cells(runs: list[Run]) -> tuple[pd.DataFrame, dict[tuple, dict[str, float]], dict[tuple, dict[str, str] | None]]:
    """One row per cell: its key, policy, budget, n, mean and interval, and what a sample cost (``Run.sample_costs``;
    a column none of the cells has left out); each cell's scores by sample id (the full cache, whose budget is no
    setting, once); and each cell's samples' clusters (contexts, a problem's draws), by which its intervals resample
    (:meth:`~kvbench.finished.Run.sample_clusters`)."""
    rows, scores, clusters = [], {}, {}
    for run in runs:
        identity, kind, clustered, costs = run.table_identity(), run.metric, run.sample_clusters(), run.sample_costs()
        for subtask, by_id in run.sample_scores().items():
            key = (identity["model"], task_label(run), subtask, kind, run.context, identity["regime"])
            policy, budget = identity["policy"], identity["budget"]
            if (*key, policy, budget) in scores:  # the full cache run at several budgets: one cell
                continue
            scores[(*key, policy, budget)], clusters[(*key, policy, budget)] = by_id, clustered
            of = None if clustered is None else [clustered.get(sample, sample) for sample in by_id]
            interval = bootstrap_mean(list(by_id.values()), clusters=of)
            rows.append(
                {
                    **dict(zip(CELL, key)),
                    "policy": policy,
                    "budget": budget,
                    "n": interval.n,
                    "mean": interval.mean,
                    "low": interval.low,
                    "high": interval.high,
                    **costs.get(subtask, {}),
                }
            )
    columns = [*CELL, "policy", "budget", "n", "mean", "low", "high", *COST_NAMES]
    frame = pd.DataFrame(rows, columns=columns)
    return frame.drop(columns=[cost for cost in COST_NAMES if frame[cost].isna().all()]), scores, clusters


def comparisons(
    scores: dict[tuple, dict[str, float]], clusters: dict[tuple, dict[str, str] | None], baseline: str | None = None
) -> pd.DataFrame:
    """Each ``base+modifier`` cell against its ``base`` cell at the same budget — with ``baseline``, every other cell
    against the ``baseline`` policy's at the same budget (the full cache's at any) —: the paired difference of their
    scores over the samples both scored, its interval (clustered as the samples are: contexts, a problem's draws), and
    whether the interval excludes zero."""
    rows = []
    for (*key, policy, budget), treated in scores.items():
        base = str(policy).split("+")[0] if baseline is None else baseline
        control = scores.get((*key, base, budget)) or scores.get((*key, base, NO_BUDGET))
        if base == policy or control is None:
            continue
        difference = paired_difference(treated, control, clusters=clusters[(*key, policy, budget)])
        rows.append(
            {
                **dict(zip(CELL, key)),
                "policy": policy,
                "base": base,
                "budget": budget,
                "n": difference.n,
                "difference": difference.mean,
                "low": difference.low,
                "high": difference.high,
                "differs": difference.excludes_zero,
            }
        )
    columns = [*CELL, "policy", "base", "budget", "n", "difference", "low", "high", "differs"]
    return pd.DataFrame(rows, columns=columns)


def by_budget(frame: pd.DataFrame, label: str, text) -> pd.DataFrame:
    """``frame``'s rows as one row per (cell key, policy[, base]) and a column per budget (the full cache's ``–``, then
    ascending), each entry ``text(row)``, and a ``label`` column with the smallest n of the row's cells; the columns of
    the cell key that are the same on every row are left out (the long tables have them)."""
    keys = [column for column in [*CELL, "policy", "base"] if column in frame.columns]
    rows = []
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row[label] = int(group["n"].min())
        row.update({str(entry.budget): text(entry) for entry in group.itertuples()})
        rows.append(row)
    budgets = sorted({str(spec) for spec in frame["budget"]}, key=lambda spec: (spec != NO_BUDGET, budget_key(spec)))
    wide = pd.DataFrame(rows, columns=[*keys, label, *budgets])
    wide = wide.astype({column: object for column in wide.columns[wide.isna().any()]}).fillna("")  # no NaN upcast
    constant = [column for column in CELL if wide[column].nunique(dropna=False) == 1]
    return wide.drop(columns=constant)


def summaries(table: pd.DataFrame, paired: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The two tables in short, one of each per task, a column per budget: ``leaderboard_summary_<task>``, each cell's
    ``mean [low, high]``; ``leaderboard_paired_summary_<task>``, each modifier's paired difference from its base
    ``Δ [low, high]``, with ``*`` where the interval excludes zero (a perplexity to two decimals)."""

    def cell(row) -> str:
        digits = 2 if row.metric == "perplexity" else 1
        return f"{row.mean:.{digits}f} [{row.low:.{digits}f}, {row.high:.{digits}f}]"

    def difference(row) -> str:
        digits = 2 if row.metric == "perplexity" else 1
        text = f"{row.difference:+.{digits}f} [{row.low:+.{digits}f}, {row.high:+.{digits}f}]"
        return text + ("*" if row.differs else "")

    short = {}
    for task, cells_of_task in table.groupby("task", sort=False):
        short[f"leaderboard_summary_{task}"] = by_budget(cells_of_task, "n", cell)
        paired_of_task = paired[paired["task"] == task]
        if not paired_of_task.empty:
            short[f"leaderboard_paired_summary_{task}"] = by_budget(paired_of_task, "n", difference)
    return short


def leaderboard_tables(runs: list[Run], baseline: str | None = None) -> dict[str, pd.DataFrame]:
    """``leaderboard_cells`` and ``leaderboard_paired`` (see :func:`cells`, :func:`comparisons`; each modifier against
    its base, or every policy against ``baseline``), by task and subtask, then in the papers' order, and both in short
    (:func:`summaries`)."""
    table, scores, clusters = cells(runs)
    if table.empty:
        return {}
    if baseline is not None:
        choose("baseline policy (--baseline)", baseline, set(table["policy"]))
    tables = {"leaderboard_cells": table, "leaderboard_paired": comparisons(scores, clusters, baseline)}
    tables = {name: sort_rows(frame).sort_values(["task", "subtask"], kind="stable") for name, frame in tables.items()}
    return {**tables, **summaries(tables["leaderboard_cells"], tables["leaderboard_paired"])}


def installed(package: str) -> str | None:
    """The installed version of ``package``, read without importing it (a report imports no model library), or None
    where no distribution names it (a build from source)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def provenance(command: str, started: float | None, commit: str | None, runs: list[Run]) -> dict[str, object]:
    """What made the runs: ``command``, its start, end and wall seconds (from ``started``, epoch seconds), the kvbench
    ``commit`` it ran (``git describe --dirty``, taken when it started), the versions that ran, the counts of runs
    and scored samples, and ``sample_seconds``: the prefill and decode seconds of every record summed (each record
    holds its share of what its group shared), the sweep's work whatever invocations it took when it was resumed
    (``wall_seconds`` is the last invocation's)."""
    import kvbench

    finished = time.time()
    return {
        "command": command,
        "started": None if started is None else datetime.fromtimestamp(started, timezone.utc).isoformat(),
        "finished": datetime.fromtimestamp(finished, timezone.utc).isoformat(),
        "wall_seconds": None if started is None else round(finished - started, 1),
        "commit": commit or None,
        "versions": {
            "kvbench": kvbench.__version__,
            "python": platform.python_version(),
            "torch": installed("torch"),
            "transformers": installed("transformers"),
        },
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPU cores",
        "runs": len(runs),
        "samples": sum(len(run.records) for run in runs),
        "sample_seconds": round(
            sum((record.get("timing") or {}).get("total_seconds", 0.0) for run in runs for record in run.records), 1
        ),
    }


def leaderboard_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="kvbench leaderboard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories, or folders holding them (a sweep directory)")
    parser.add_argument("--format", default="markdown", help="markdown (default), csv, latex")
    parser.add_argument(
        "--output-dir", type=Path, help="also write each table to DIR/<table>.<md|csv|tex>, and DIR/leaderboard.png"
    )
    parser.add_argument(
        "--baseline", metavar="SPEC", help="pair every policy with SPEC (e.g. snapkv), not each modifier with its base"
    )
    parser.add_argument("--provenance", metavar="COMMAND", help="with --output-dir: the command that made the runs")
    parser.add_argument("--started", type=float, help="with --provenance: when COMMAND started (epoch seconds)")
    parser.add_argument("--commit", help="with --provenance: the kvbench commit COMMAND ran")
    options = parser.parse_args(args)
    choose("format", options.format, FORMATS)
    runs = load_runs(options.run_dirs)
    tables = leaderboard_tables(runs, options.baseline)
    if not tables:
        raise KVBenchError(f"no finished run with per-sample scores under {' '.join(map(str, options.run_dirs))}")
    print_tables({name: frame for name, frame in tables.items() if not frame.empty}, options.format, options.output_dir)
    if tables["leaderboard_paired"].empty:  # said once, rather than an empty table under its header
        print(
            "kvbench leaderboard: nothing paired (no modifier beside its base at a budget in these runs); "
            "--baseline SPEC pairs every policy with SPEC",
            file=sys.stderr,
        )
    if options.output_dir is not None:
        print(f"wrote {save(leaderboard_figure(tables['leaderboard_cells']), options.output_dir / 'leaderboard.png')}")
    if options.output_dir is not None and options.provenance:
        path = options.output_dir / "provenance.json"
        made = provenance(options.provenance, options.started, options.commit, runs)
        path.write_text(json.dumps(made, indent=2) + "\n")
        print(f"wrote {path}")
