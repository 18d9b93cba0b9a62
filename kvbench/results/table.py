"""``kvbench table RUN_DIR...``: run directories aggregated into the benchmarks' table layouts.

Layouts (``--layout``; ``auto`` makes every benchmark layout the runs found have data for, and ``runs``):

* ``longbench``  LongBench by task, grouped by category, with Avg. (the mean of the task scores, as the
  papers print it), and LongBench by category (each category the mean of its tasks);
* ``ruler``      RULER by task with Avg., one row per run and context length;
* ``niah``       needle accuracy of the needle tasks by context length × budget (the per-record
  ``context_length``), the full cache in columns of its own, with Avg.;
* ``ppl``        perplexity beside the full cache's for the same model, text and length, and the gap;
* ``query_modes`` each run's average under ``task.query_mode=aware`` and ``agnostic`` side by side (the same
  samples, the context compressed with or without its question), the difference with its paired interval
  (clustered by context), the agnostic run's compressions and both runs' time (made by ``auto`` when the runs hold
  both modes);
* ``runs``       one row per run (every run): its average, cache size and time, and the scores of a task
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
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import pandas as pd
from hydra.utils import get_class
from omegaconf import OmegaConf

from kvbench import CONF_DIR, config_dict
from kvbench.errors import KVBenchError, choose
from kvbench.policies.budgets import Budget
from kvbench.results.intervals import paired_difference
from kvbench.rundir import RunDir, find_run_dirs, scan_run_dirs
from kvbench.tasks.base import TableLayout, Task

IDENTITY = ["model", "policy", "budget", "regime"]
NO_BUDGET = "–"
"""The budget column of the full cache, which keeps every token whatever budget its run was given."""

AVG = "Avg."


@dataclass
class Run:
    """One finished run directory: its metrics and the resolved config it ran with."""

    run_dir: RunDir

    @cached_property
    def metrics(self) -> dict[str, Any]:
        return self.run_dir.metrics()

    @cached_property
    def config(self) -> dict[str, Any]:
        if not self.run_dir.config_path.exists():
            return {}
        return config_dict(OmegaConf.load(self.run_dir.config_path))

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        return self.run_dir.records()

    @property
    def task(self) -> str:
        return self.metrics["task"]

    @property
    def context(self) -> int | None:
        """The run's context length: RULER's ``context_length``, the perplexity window, LongBench's limit or
        NeedleBench's grid (``8k``)."""
        task = self.config.get("task", {})
        for key in ("context_length", "max_tokens", "max_length"):
            if task.get(key) is not None:
                return int(task[key])
        grid = str(task.get("grid") or "")
        return int(grid[:-1]) * 1024 if grid[:-1].isdigit() and grid.endswith("k") else None

    @property
    def metric(self) -> str:
        """What the run's sample scores are: ``perplexity`` where its records carry token NLLs (the perplexity tasks,
        whose ``score`` is the window's perplexity), else ``score`` (0–1, shown ×100)."""
        return "perplexity" if any("nll" in record for record in self.records) else "score"

    def sample_scores(self) -> dict[str, dict[str, float]]:
        """The run's per-sample scores by subtask (the task's name where records have none): ``{subtask: {sample id:
        score}}``, from each record's numeric ``score``: ×100, a perplexity as it is (:attr:`metric`)."""
        scale = 1.0 if self.metric == "perplexity" else 100.0
        scores: dict[str, dict[str, float]] = {}
        for record in self.records:
            score = record.get("score")
            if isinstance(score, int | float) and not isinstance(score, bool):
                scores.setdefault(record.get("subtask") or self.task, {})[str(record["id"])] = scale * float(score)
        return scores

    def sample_contexts(self) -> dict[str, str] | None:
        """Each sample id's ``context_id`` where the run's questions share contexts (RULER's
        ``questions_per_context``, LongBench's repeated documents): their intervals resample whole contexts. None
        where no record has one."""
        contexts = {str(record["id"]): str(record["context_id"]) for record in self.records if "context_id" in record}
        return contexts or None

    @property
    def query_mode(self) -> str:
        """``task.query_mode``: ``aware`` (also a run from before the setting) or ``agnostic``."""
        return str(self.config.get("task", {}).get("query_mode") or "aware")

    @property
    def data(self) -> str:
        """What a perplexity run read: the text file's stem, else the task name."""
        path = self.config.get("task", {}).get("path")
        return Path(path).stem if path else self.task

    @property
    def settings(self) -> dict[str, Any]:
        """The policy's hyper-parameters (``policy.*`` of the config, without ``name``); the layer budget as its
        name, its own settings as ``layer_budget.<key>``."""
        settings = {key: value for key, value in self.config.get("policy", {}).items() if key != "name"}
        layer_budget = settings.pop("layer_budget", None)
        if isinstance(layer_budget, dict):
            settings["layer_budget"] = layer_budget.get("name")
            settings.update({f"layer_budget.{key}": value for key, value in layer_budget.items() if key != "name"})
        return settings

    @property
    def label(self) -> str:
        """``policy@budget``; the full cache as ``full`` (it keeps every token whatever its budget)."""
        policy = self.identity()["policy"]
        return policy if policy == "full" else f"{policy}@{self.metrics['budget']}"

    def identity(self) -> dict[str, Any]:
        """Model, policy (its label: :attr:`~kvbench.policies.base.Policy.label`), budget (none for the full cache)
        and regime."""
        identity = {key: self.metrics.get(key) for key in IDENTITY}
        identity["policy"] = self.metrics.get("label", identity["policy"])
        return {**identity, "budget": NO_BUDGET} if identity["policy"] == "full" else identity


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Every finished run at or below ``paths`` (see :func:`find_run_dirs`)."""
    return [Run(run_dir) for run_dir in find_run_dirs(paths)]


def budget_key(spec: str) -> tuple[int, float]:
    """Sort key of a budget spec: token budgets by size, then prompt fractions by size."""
    try:
        budget = Budget.parse(spec)
    except KVBenchError:
        return (2, 0.0)
    if budget.tokens is not None:
        return (0, float(budget.tokens))
    assert budget.fraction is not None  # parse gives a budget its tokens or its fraction
    return (1, budget.fraction)


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
            rows.append({**run.identity(), **extra, "score": name, "value": value})
    columns = [*IDENTITY, "task", "context", "kv_tokens", "seconds", "run_dir", "query_mode", "score", "value"]
    return pd.DataFrame(rows, columns=columns)


def _pivot(frame: pd.DataFrame, index: list[str], order: list[str]) -> pd.DataFrame:
    """Scores as columns (known ones in ``order`` first), the first value per cell, rows in paper order."""
    table = frame.pivot_table(index=index, columns="score", values="value", aggfunc="first")
    known = [name for name in order if name in table.columns]
    table = table[known + [name for name in table.columns if name not in known]]
    table.columns.name = None
    return sort_rows(table.reset_index())


@functools.cache
def task_layout(task: str) -> TableLayout | None:
    """The table layout task ``task`` declares (:attr:`~kvbench.tasks.base.Task.table`; its class as
    ``conf/task/<task>.yaml`` names it), or None: none, or a task this version does not know."""
    path = CONF_DIR / "task" / f"{task}.yaml"
    if not path.is_file():
        return None
    task_class: type[Task] = get_class(str(OmegaConf.select(OmegaConf.load(path), "_target_")))
    return task_class.table


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
                **run.identity(),
                "task": run.task,
                "context": run.context,
                "query_mode": run.query_mode,
                **({} if has_layout(run) else run.metrics["scores"]),
                "average": run.metrics.get("average"),
                "kv_tokens": sum(after) / len(after),
                "seconds": run.metrics.get("timing", {}).get("total_seconds"),
            }
        )
    frame = pd.DataFrame(rows)
    if frame.empty or frame["query_mode"].nunique() == 1:  # shown where runs differ in it
        frame = frame.drop(columns="query_mode", errors="ignore")
    return sort_rows(frame)


def longbench_tables(runs: list[Run]) -> dict[str, pd.DataFrame]:
    """LongBench by task (papers' headers, category order, Avg. = mean of the tasks present) and by category."""
    frame = scores_frame([run for run in runs if run.task == "longbench"])
    if frame.empty:
        return {}
    layout = cast(TableLayout, task_layout("longbench"))
    by_task = _pivot(frame, IDENTITY, list(layout.order))
    tasks = [column for column in by_task.columns if column not in IDENTITY]
    by_category = by_task[IDENTITY].copy()
    for category, members in layout.categories.items():
        present = [task for task in members if task in tasks]
        if present:
            by_category[category] = by_task[present].mean(axis=1)
    by_task[AVG] = by_task[tasks].mean(axis=1)
    by_category[AVG] = by_task[AVG]
    return {"longbench": by_task.rename(columns=layout.headers), "longbench_categories": by_category}


def longbench_e_table(runs: list[Run]) -> dict[str, pd.DataFrame]:
    """LongBench-E: one row per run and length bucket (``dataset@bucket`` scores), tasks as columns, Avg."""
    frame = scores_frame([run for run in runs if run.task == "longbench_e"])
    if frame.empty:
        return {}
    frame[["score", "bucket"]] = frame["score"].str.split("@", n=1, expand=True)
    layout = cast(TableLayout, task_layout("longbench_e"))
    table = _pivot(frame, [*IDENTITY, "bucket"], list(layout.order))
    tasks = [column for column in table.columns if column not in (*IDENTITY, "bucket")]
    table[AVG] = table[tasks].mean(axis=1)
    return {"longbench_e": table.rename(columns=layout.headers)}


def ruler_table(runs: list[Run]) -> dict[str, pd.DataFrame]:
    """RULER by task with Avg., one row per run and context length."""
    frame = scores_frame([run for run in runs if run.task == "ruler"])
    if frame.empty:
        return {}
    index = [*IDENTITY, "context", *(["query_mode"] if frame["query_mode"].nunique() > 1 else [])]
    table = _pivot(frame, index, list(cast(TableLayout, task_layout("ruler")).order))
    tasks = [column for column in table.columns if column not in index]
    table[AVG] = table[tasks].mean(axis=1)
    return {"ruler": table}


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
        identity = run.identity()
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
            rows.append({**run.identity(), "data": run.data, "context": run.context, "ppl": ppl})
    if not rows:
        return {}
    frame = pd.DataFrame(rows)
    full = frame[frame["policy"] == "full"].drop_duplicates(["model", "data", "context"])
    full = full[["model", "data", "context", "ppl"]].rename(columns={"ppl": "full_ppl"})
    table = frame.merge(full, on=["model", "data", "context"], how="left")
    table["ppl_gap"] = table["ppl"] - table["full_ppl"]
    return {"ppl": sort_rows(table[["model", "data", "context", *IDENTITY[1:], "ppl", "full_ppl", "ppl_gap"]])}


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
        key = (*run.identity().values(), run.task, run.context)
        by_mode.setdefault(run.query_mode, {}).setdefault(key, run)
    rows = []
    for key, agnostic in by_mode["agnostic"].items():
        aware = by_mode["aware"].get(key)
        if aware is None:
            continue
        contexts = agnostic.sample_contexts()
        difference = paired_difference(pooled(agnostic), pooled(aware), clusters=contexts)
        averages = aware.metrics["average"], agnostic.metrics["average"]
        rows.append(
            {
                **agnostic.identity(),
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


LAYOUTS: dict[str, Callable[[list[Run]], dict[str, pd.DataFrame]]] = {
    "longbench": lambda runs: {**longbench_tables(runs), **longbench_e_table(runs)},
    "ruler": ruler_table,
    "niah": niah_table,
    "ppl": ppl_table,
    "query_modes": query_mode_table,
    "runs": lambda runs: {"runs": runs_table(runs)},
}


def benchmark_tables(runs: list[Run], layout: str = "auto") -> dict[str, pd.DataFrame]:
    """The named tables of ``layout``; ``auto``: every benchmark layout with data, and one row per run for
    tasks without a layout of their own."""
    choose("layout", layout, ["auto", *LAYOUTS])
    if layout != "auto":
        tables = LAYOUTS[layout](runs)
        if not tables:
            raise KVBenchError(
                f"no runs fit the {layout!r} layout; valid choices for these runs: "
                f"{', '.join(name for name in LAYOUTS if name == 'runs' or LAYOUTS[name](runs))}"
            )
        return tables
    tables = {}
    for name in ("longbench", "ruler", "niah", "ppl", "query_modes"):
        tables.update(LAYOUTS[name](runs))
    tables.update(LAYOUTS["runs"](runs))  # every run, one row each
    return tables


FORMATS = {"markdown": "md", "csv": "csv", "latex": "tex"}


#: LaTeX's specials, escaped, and the non-ASCII symbols tables print, as text or math that pdflatex compiles
LATEX_ESCAPES = {
    **{char: f"\\{char}" for char in "&%$#_{}"},
    "\\": r"\textbackslash{}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "–": "--",
    "—": "---",
    "−": "$-$",
    "Δ": r"$\Delta$",
    "θ": r"$\theta$",
    "×": r"$\times$",
    "→": r"$\rightarrow$",
    "§": r"\S{}",
    "±": r"$\pm$",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
}


def latex_text(text: str) -> str:
    """``text`` as LaTeX source: specials escaped, symbols in text or math mode."""
    return "".join(LATEX_ESCAPES.get(char, char) for char in text)


def latex_table(table: pd.DataFrame, decimals: int) -> str:
    """A booktabs ``tabular`` (``\\usepackage{booktabs}``): names escaped, numbers right-aligned with ``decimals``
    places, empty cells ``--``."""

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return "--"
        if isinstance(value, float):
            return f"{value:.{decimals}f}"
        return latex_text(str(value))

    numeric = [pd.api.types.is_numeric_dtype(dtype) for dtype in table.dtypes]
    lines = [
        r"\begin{tabular}{" + "".join("r" if number else "l" for number in numeric) + "}",
        r"\toprule",
        " & ".join(latex_text(str(name)) for name in table.columns) + r" \\",
        r"\midrule",
        *(" & ".join(cell(value) for value in row) + r" \\" for row in table.astype(object).itertuples(index=False)),
        r"\bottomrule",
        r"\end{tabular}",
    ]
    return "\n".join(lines) + "\n"


def render(table: pd.DataFrame, fmt: str, decimals: int = 2) -> str:
    """A table as Markdown, CSV or LaTeX; numbers with ``decimals`` places, empty cells as ``–``."""
    choose("format", fmt, FORMATS)
    if fmt == "csv":
        return table.to_csv(index=False)
    if fmt == "latex":
        return latex_table(table, decimals)
    cells = table.astype(object).where(table.notna(), None)  # tabulate prints None, not NaN, as missingval
    return cells.to_markdown(index=False, floatfmt=f".{decimals}f", missingval="–")


def write_tables(tables: dict[str, str], output_dir: Path, fmt: str) -> list[Path]:
    """Write rendered tables as ``<output_dir>/<name>.<md|csv|tex>``; returns the paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in tables.items():
        path = output_dir / f"{name}.{FORMATS[fmt]}"
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        paths.append(path)
    return paths


TITLES = {
    "longbench": "LongBench by task",
    "longbench_categories": "LongBench by category",
    "longbench_e": "LongBench-E",
    "ruler": "RULER by task",
    "niah": "Needle accuracy by context × budget",
    "ppl": "Perplexity and gap to full cache",
    "query_modes": "Query-aware and query-agnostic side by side",
    "runs": "Runs",
}


def print_tables(tables: dict[str, pd.DataFrame], fmt: str, output_dir: Path | None) -> None:
    """Print each table rendered in ``fmt`` (Markdown under a heading), and write them to ``output_dir`` if given."""
    rendered = {name: render(table, fmt) for name, table in tables.items()}
    for name, text in rendered.items():
        if fmt == "markdown":
            print(f"\n### {TITLES.get(name, name)}\n")
        print(text.rstrip("\n"))
    if output_dir:
        for path in write_tables(rendered, output_dir, fmt):
            print(f"wrote {path}")


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="kvbench table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories, or folders holding them (a sweep directory)")
    parser.add_argument("--layout", default="auto", help=f"auto (default), {', '.join(LAYOUTS)}")
    parser.add_argument("--format", default="markdown", help="markdown (default), csv, latex")
    parser.add_argument("--output-dir", type=Path, help="also write each table to DIR/<table>.<md|csv|tex>")
    options = parser.parse_args(args)
    choose("format", options.format, FORMATS)
    finished, left_out = scan_run_dirs(options.run_dirs)
    tables = benchmark_tables([Run(run_dir) for run_dir in finished], options.layout)
    print_tables(tables, options.format, options.output_dir)
    if left_out:
        print(f"\nnot in the tables: {len(left_out)} run directories")
        for run_dir, reason in left_out:
            print(f"  {run_dir.path}: {reason}")


__all__ = ["Run", "benchmark_tables", "load_runs", "main", "render", "scores_frame"]
