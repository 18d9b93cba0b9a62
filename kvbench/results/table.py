"""``kvbench table RUN_DIR...``: run directories aggregated into the benchmarks' table layouts.

Layouts (``--layout``; ``auto`` makes every benchmark layout the runs found have data for, and ``runs``):

* ``<task>``     each task that declares a table (:class:`~kvbench.tasks.base.TableLayout`; ``longbench``,
  ``longbench_e``, ``ruler``): its subtasks in its order under the papers' headers with Avg. (the mean of the
  subtask scores, as the papers print it), a row per run (and per length bucket or context length where the task
  says), and by category where it declares categories (each the mean of its subtasks);
* ``niah``       needle accuracy of the needle tasks by context length × budget (the per-record
  ``context_length``), the full cache in columns of its own, with Avg.;
* ``ppl``        perplexity beside the full cache's for the same model, text and length, and the gap;
* ``query_modes`` each run's average under ``task.query_mode=aware`` and ``agnostic`` side by side (the same
  samples, the context compressed with or without its question), the difference with its paired interval
  (clustered by context), the agnostic run's compressions and both runs' time (made by ``auto`` when the runs hold
  both modes);
* ``runs``       one row per run (every run): its average, cache size, what a sample cost (``generated``: the
  mean tokens generated; ``kv_peak_mib``: the mean of each sample's most cache, MiB; ``kv_mean_mib``: where the
  cache evicts while decoding, of what it held on average over its generation) and time, and the scores of a task
  without a table of its own.

The full cache keeps every token: its budget is shown as ``–``. A cell a row did not run is empty (``–``).
Scores are on the 0–100 scale of ``metrics.json``; ``kv_tokens`` is the mean cache size per layer
after prefill and ``seconds`` the run's total time. Run directories without readable metrics (unfinished,
failed, being written) are listed below the tables, each with the reason.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.budgets import Budget
from kvbench.errors import KVBenchError, choose
from kvbench.finished import COST_NAMES, Run, scan_run_dirs
from kvbench.identity import TABLE_IDENTITY
from kvbench.results.intervals import paired_difference
from kvbench.results.render import FORMATS, print_tables
from kvbench.tasks.base import TableLayout
from kvbench.tasks.registry import tabled_tasks, task_class

AVG = "Avg."


def budget_key(spec: str) -> tuple[int, float]:
    """Sort key of a budget spec: token budgets by size, then prompt fractions, fractions of the full cache's bytes
    and byte counts, each by size."""
    try:
        budget = Budget.parse(spec)
    except KVBenchError:
        return (4, 0.0)
    forms = (budget.tokens, budget.fraction, budget.byte_fraction, budget.byte_count)
    kind = next(index for index, value in enumerate(forms) if value is not None)
    return (kind, float(forms[kind] or 0))


def policy_key(spec: str) -> tuple[int, str, int, str]:
    """Sort key of a policy spec: ``full`` first, then each base followed by its modified forms."""
    base, *modifiers = spec.split("+")
    return (0 if base == "full" else 1, base, len(modifiers), spec)


def context_label(tokens: int | None) -> str:
    """``8192`` → ``8k`` (the papers' column labels); other lengths as they are."""
    if tokens is None:
        return ""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def sort_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows in the papers' order: by model, then full cache first and each base before its modifiers, budgets
    ascending; contexts ascending where the frame has them."""
    keys = {"policy": policy_key, "budget": budget_key}
    columns = [
        column
        for column in ("model", "data", "context", "benchmark", "policy", "budget", "regime", "bucket")
        if column in frame.columns
    ]
    ordered = frame.sort_values(
        columns,
        key=lambda column: column.map(keys[column.name]) if column.name in keys else column,
        kind="stable",
    )
    return ordered.reset_index(drop=True)


def scores_frame(runs: list[Run]) -> pd.DataFrame:
    """A long frame: one row per (run, score) with the run's identity, context and cost figures."""
    rows = []
    for run in runs:
        kv = run.metrics.get("kv_cache", {})
        after = kv.get("after_prefill_tokens_per_layer") or [0]
        extra = {
            "task": run.task,
            "context": run.context,
            "kv_tokens": sum(after) / len(after),
            "seconds": run.metrics.get("timing", {}).get("total_seconds"),
            "run_dir": str(run.run_dir.path),
            "query_mode": run.query_mode,
        }
        for name, value in run.metrics["scores"].items():
            rows.append({**run.table_identity(), **extra, "score": name, "value": value})
    columns = [*TABLE_IDENTITY, "task", "context", "kv_tokens", "seconds", "run_dir", "query_mode", "score", "value"]
    return pd.DataFrame(rows, columns=columns)


def _pivot(frame: pd.DataFrame, index: list[str], order: list[str]) -> pd.DataFrame:
    """Scores as columns (known ones in ``order`` first), the first value per cell, rows in paper order."""
    table = frame.pivot_table(index=index, columns="score", values="value", aggfunc="first")
    known = [name for name in order if name in table.columns]
    table = table[known + [name for name in table.columns if name not in known]]
    table.columns.name = None
    return sort_rows(table.reset_index())


def task_layout(task: str) -> TableLayout | None:
    """The table task ``task`` declares (:attr:`~kvbench.tasks.base.Task.table`), or None: none, or a task this
    version does not know."""
    task_type = task_class(task)
    return None if task_type is None else task_type.table


def has_layout(run: Run) -> bool:
    """Whether a benchmark table shows the run's scores (a task that declares one, perplexity)."""
    return task_layout(run.task) is not None or "ppl" in run.metrics["scores"]


def runs_table(runs: list[Run]) -> pd.DataFrame:
    """One row per run: its average, cache size, time and directory, and every score of a task without a table of
    its own (the needle tasks; the other tasks' scores are in their tables)."""
    rows = []
    for run in runs:
        kv = run.metrics.get("kv_cache", {})
        after = kv.get("after_prefill_tokens_per_layer") or [0]
        rows.append(
            {
                **run.table_identity(),
                "task": run.task,
                "context": run.context,
                "query_mode": run.query_mode,
                **({} if has_layout(run) else run.metrics["scores"]),
                "average": run.metrics.get("average"),
                "kv_tokens": sum(after) / len(after),
                **run.sample_costs(pooled=True).get("", {}),
                "seconds": run.metrics.get("timing", {}).get("total_seconds"),
            }
        )
    frame = pd.DataFrame(rows)
    frame = frame.drop(columns=[name for name in COST_NAMES if name in frame and frame[name].isna().all()])
    if frame.empty or frame["query_mode"].nunique() == 1:  # shown where runs differ in it
        frame = frame.drop(columns="query_mode", errors="ignore")
    return sort_rows(frame)


def task_tables(runs: list[Run], task: str) -> dict[str, pd.DataFrame]:
    """Task ``task``'s runs laid out as it declares (:class:`~kvbench.tasks.base.TableLayout`): ``<task>``, its
    subtasks as columns in the declared order under the papers' headers, a row per run (and per bucket, context
    length and query mode where the layout or the runs have several), Avg. = the mean of the subtasks present;
    ``<task>_categories``, each category the mean of its subtasks present."""
    layout = task_layout(task)
    frame = scores_frame([run for run in runs if run.task == task])
    if layout is None or frame.empty:
        return {}
    index = list(TABLE_IDENTITY)
    if layout.buckets:
        frame[["score", "bucket"]] = frame["score"].str.split("@", n=1, expand=True)
        index.append("bucket")
    if layout.by_context:
        index.append("context")
    if frame["query_mode"].nunique() > 1:
        index.append("query_mode")
    by_subtask = _pivot(frame, index, list(layout.order))
    subtasks = [column for column in by_subtask.columns if column not in index]
    by_subtask[AVG] = by_subtask[subtasks].mean(axis=1)
    tables = {task: by_subtask.rename(columns=layout.headers)}
    if layout.categories:
        by_category = by_subtask[index].copy()
        for category, members in layout.categories.items():
            present = [subtask for subtask in members if subtask in subtasks]
            if present:
                by_category[category] = by_subtask[present].mean(axis=1)
        by_category[AVG] = by_subtask[AVG]
        tables[f"{task}_categories"] = by_category
    return tables


def record_value(record: dict[str, Any], key: str) -> Any:
    """A record's field, looked up at the top level and then in its ``metadata``."""
    if key in record:
        return record[key]
    return (record.get("metadata") or {}).get(key)


def needle_records(run: Run) -> list[dict[str, Any]]:
    """The run's records that carry a ``depth`` and a ``context_length`` (the needle task's grid)."""
    if has_layout(run):
        return []
    return [
        record
        for record in run.records
        if record_value(record, "depth") is not None and record_value(record, "context_length") is not None
    ]


def niah_frame(runs: list[Run]) -> pd.DataFrame:
    """Needle accuracy (0–100) of the needle tasks per model, policy, regime, benchmark, context length and
    budget (RULER's NIAH subtasks are in the RULER table, one row per context)."""
    rows = []
    for run in runs:
        identity = run.table_identity()
        base = {key: identity[key] for key in ("model", "policy", "regime", "budget")}
        by_context: dict[int, list[float]] = {}
        for record in needle_records(run):
            by_context.setdefault(int(record_value(record, "context_length")), []).append(float(record["score"]))
        for context, scores in by_context.items():
            rows.append({**base, "benchmark": run.task, "context": context, "value": 100.0 * sum(scores) / len(scores)})
    return pd.DataFrame(rows, columns=["model", "policy", "regime", "budget", "benchmark", "context", "value"])


def niah_table(runs: list[Run]) -> dict[str, pd.DataFrame]:
    """Needle accuracy by context × budget (columns ``<context>/<budget>``, as OBCache Table 1; the full cache
    in columns ``<context>/–`` of its own), then ``Avg./<budget>`` for each budget: over the contexts each row ran
    at that budget (a budget is never averaged with another).

    Made when some needle benchmark was run at more than one context length."""
    frame = niah_frame(runs)
    if frame.empty or frame.groupby(["model", "benchmark"])["context"].nunique().max() < 2:
        return {}
    frame = frame.drop_duplicates(["model", "policy", "regime", "benchmark", "context", "budget"])
    cells = sorted(
        {(context, budget) for context, budget in zip(frame["context"], frame["budget"])},
        key=lambda cell: (cell[0], budget_key(cell[1])),
    )
    frame["cell"] = [f"{context_label(c)}/{b}" for c, b in zip(frame["context"], frame["budget"])]
    index = ["model", "benchmark", "policy", "regime"]
    table = frame.pivot_table(index=index, columns="cell", values="value", aggfunc="first")
    columns = [f"{context_label(c)}/{b}" for c, b in cells]
    table = table[columns]
    table.columns.name = None
    for budget in sorted({budget for _, budget in cells}, key=budget_key):
        table[f"{AVG}/{budget}"] = table[[f"{context_label(c)}/{b}" for c, b in cells if b == budget]].mean(axis=1)
    return {"niah": sort_rows(table.reset_index())}


def ppl_table(runs: list[Run]) -> dict[str, pd.DataFrame]:
    """Perplexity per run beside the full cache's (same model, text and length) and the gap (CAOTE Table 4)."""
    rows = []
    for run in runs:
        if "ppl" in run.metrics["scores"]:
            ppl = run.metrics["scores"]["ppl"]
            rows.append({**run.table_identity(), "data": run.data, "context": run.context, "ppl": ppl})
    if not rows:
        return {}
    frame = pd.DataFrame(rows)
    full = frame[frame["policy"] == "full"].drop_duplicates(["model", "data", "context"])
    full = full[["model", "data", "context", "ppl"]].rename(columns={"ppl": "full_ppl"})
    table = frame.merge(full, on=["model", "data", "context"], how="left")
    table["ppl_gap"] = table["ppl"] - table["full_ppl"]
    return {"ppl": sort_rows(table[["model", "data", "context", *TABLE_IDENTITY[1:], "ppl", "full_ppl", "ppl_gap"]])}


def compressions(run: Run) -> float:
    """How many times the run compressed a context: once per record, less the questions that shared one compression
    (a record's ``timing.context_shared_by``)."""
    return sum(1 / record.get("timing", {}).get("context_shared_by", 1) for record in run.records)


def query_mode_table(runs: list[Run]) -> dict[str, pd.DataFrame]:
    """``query_modes``: one row per identity, task and context run under both query modes: their averages side by side,
    ``agnostic − aware`` with the 95 % interval of the paired per-sample difference (``Δ low``, ``Δ high``, over the
    ``n`` samples both scored, whole contexts resampled where questions share one), the contexts among them, the
    agnostic run's compressions (:func:`compressions`) and both runs' seconds. Of several rows, the model, regime,
    task and context are left out where every row has the same."""
    by_mode: dict[str, dict[tuple, Run]] = {"aware": {}, "agnostic": {}}
    for run in runs:
        key = (*run.table_identity().values(), run.task, run.context)
        by_mode.setdefault(run.query_mode, {}).setdefault(key, run)
    rows = []
    for key, agnostic in by_mode["agnostic"].items():
        aware = by_mode["aware"].get(key)
        if aware is None:
            continue
        contexts = agnostic.sample_clusters()
        difference = paired_difference(pooled(agnostic), pooled(aware), clusters=contexts)
        averages = aware.metrics["average"], agnostic.metrics["average"]
        rows.append(
            {
                **agnostic.table_identity(),
                "task": agnostic.task,
                "context": agnostic.context,
                "aware": averages[0],
                "agnostic": averages[1],
                "agnostic − aware": averages[1] - averages[0],
                "Δ low": difference.low,
                "Δ high": difference.high,
                "n": difference.n,
                "contexts": len(set(contexts.values())) if contexts else difference.n,
                "agnostic compressions": compressions(agnostic),
                "aware seconds": aware.metrics.get("timing", {}).get("total_seconds"),
                "agnostic seconds": agnostic.metrics.get("timing", {}).get("total_seconds"),
            }
        )
    if not rows:
        return {}
    table = sort_rows(pd.DataFrame(rows))
    constant = [column for column in ("model", "regime", "task", "context") if table[column].nunique() == 1]
    return {"query_modes": table.drop(columns=constant) if len(table) > 1 else table}


def pooled(run: Run) -> dict[str, float]:
    """The run's per-sample scores of every subtask, by sample id (:meth:`Run.sample_scores`)."""
    return {sample: score for by_id in run.sample_scores().values() for sample, score in by_id.items()}


#: the layouts of every report, beside each task's (:func:`layouts`)
REPORTS: dict[str, Callable[[list[Run]], dict[str, pd.DataFrame]]] = {
    "niah": niah_table,
    "ppl": ppl_table,
    "query_modes": query_mode_table,
    "runs": lambda runs: {"runs": runs_table(runs)},
}

TITLES = {
    "niah": "Needle accuracy by context × budget",
    "ppl": "Perplexity and gap to full cache",
    "query_modes": "Query-aware and query-agnostic side by side",
    "runs": "Runs",
}


def layouts() -> dict[str, Callable[[list[Run]], dict[str, pd.DataFrame]]]:
    """Every ``--layout``: each task that declares a table (by name), then the reports."""
    by_task = {task: functools.partial(task_tables, task=task) for task in tabled_tasks()}
    return {**by_task, **REPORTS}


def title(name: str) -> str:
    """A table's heading: ``<benchmark> by task`` / ``by category`` for a task's tables, else the report's."""
    task = name.removesuffix("_categories")
    layout = task_layout(task)
    if layout is None:
        return TITLES.get(name, name)
    return f"{layout.title} by {'task' if task == name else 'category'}"


def benchmark_tables(runs: list[Run], layout: str = "auto") -> dict[str, pd.DataFrame]:
    """The named tables of ``layout``; ``auto``: every benchmark layout with data, and one row per run for
    tasks without a layout of their own."""
    choices = layouts()
    choose("layout", layout, ["auto", *choices])
    if layout != "auto":
        tables = choices[layout](runs)
        if not tables:
            raise KVBenchError(
                f"no runs fit the {layout!r} layout; valid choices for these runs: "
                f"{', '.join(name for name, make in choices.items() if name == 'runs' or make(runs))}"
            )
        return tables
    tables = {}
    for make in choices.values():  # the runs table last: every run, one row each
        tables.update(make(runs))
    return tables


def table_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="kvbench table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories, or folders holding them (a sweep directory)")
    parser.add_argument("--layout", default="auto", help=f"auto (default), {', '.join(layouts())}")
    parser.add_argument("--format", default="markdown", help="markdown (default), csv, latex")
    parser.add_argument("--output-dir", type=Path, help="also write each table to DIR/<table>.<md|csv|tex>")
    options = parser.parse_args(args)
    choose("format", options.format, FORMATS)
    finished, left_out = scan_run_dirs(options.run_dirs)
    tables = benchmark_tables([Run(run_dir) for run_dir in finished], options.layout)
    print_tables(tables, options.format, options.output_dir, title)
    if left_out:
        print(f"\nnot in the tables: {len(left_out)} run directories")
        for run_dir, reason in left_out:
            print(f"  {run_dir.path}: {reason}")


__all__ = ["benchmark_tables", "scores_frame", "table_main", "task_tables"]
