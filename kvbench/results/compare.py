"""``kvbench compare-paper PAPER:TABLE RUN_DIR...``: a paper's table with our measured values beside it.

Every row the paper printed (model, method, budget) is followed by a row ``ours`` with what our runs
measured for that cell — ``not run`` where we have nothing — and a row ``Δ`` (ours − paper) where we have
something. Rows of ours that match no row of the paper (another model such as SmolLM2, another budget)
follow the paper's rows, their method bracketed with the settings that differ from the paper's main ones.

Matching: the model by kvbench name; the budget by value (``2k`` = ``2048``), the paper's ``full`` rows by the
``full`` policy; the method by policy spec and settings. A paper's method stands for its main settings
(:data:`kvbench.papers.MAIN_SETTINGS`: the values of every setting the paper varies in bracketed rows, e.g.
CaliDrop's θ1/θ2, OBCache's ``gqa``, SLAKE's ``layer_budget`` of cake+slake) with its bracketed settings over them
(``h2o+obcache_key[gqa=sum]``): a run fills a row only if each of these settings that its policy has equals the
row's value, so a θ-sweep run never fills CaliDrop Table 1's default row and the default run fills Table 2's
``[theta1=0.70,theta2=0.85]`` row. Two runs that fill the same cell with different settings (another window,
say) are an error naming the difference: the comparison never picks one silently.

Cells: a score of the run by its name (LongBench datasets, RULER subtasks, ``<subtask>@<context>`` from the
run's context length, NeedleBench's ``reasoning_en`` as ``needlebench_multi_reasoning_en``), a task's name for
the run's ``overall`` score or average (CAOTE's and CaliDrop's ``niah``), ``ppl`` and ``ppl_gap`` (to the full
cache of the same model, text and length). A printed average (``avg`` or budget ``all``) is recomputed from our
values of the cells it averages — for a table that prints only averages, the tasks of the table named in
:data:`~kvbench.papers.AVERAGED_TASKS` — marked ``*`` when we ran only some of them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.budgets import Budget
from kvbench.errors import KVBenchError, choose
from kvbench.finished import Run, load_runs
from kvbench.papers import (
    ALIASES,
    AVERAGED_TASKS,
    MAIN_SETTINGS,
    SCALES,
    list_tables,
    load_table,
    split_method,
    table_caption,
)
from kvbench.results.render import FORMATS, render, write_tables
from kvbench.results.table import budget_key, context_label, policy_key
from kvbench.tasks.registry import tabled_tasks

NOT_RUN = "not run"
PARTIAL = "*"
AGGREGATES = ("avg",)
KEY = ["model", "method", "budget"]


def table_spec(spec: str) -> tuple[str, str]:
    """``caote:table2`` (or ``caote:2``, ``calidrop:niah_text``) → ``("caote", "table2")``, checked against the
    transcribed tables."""
    paper, sep, table = spec.partition(":")
    if not sep or not table:
        raise KVBenchError(
            f"bad table {spec!r}; use PAPER:TABLE, e.g. caote:table2; valid choices: "
            + ", ".join(f"{p}:{t}" for p, t in list_tables())
        )
    table = f"table{table}" if table.isdigit() else table  # caote:2
    table_caption(paper, table)
    return paper, table


def same_setting(ours: Any, theirs: str) -> bool:
    """A run's setting equals a paper's bracketed one (numbers by value, words case-insensitively)."""
    try:
        return abs(float(ours) - float(theirs)) < 1e-9
    except (TypeError, ValueError):
        return str(ours).lower() == str(theirs).lower()


def method_fit(method: str, policy: str, settings: dict[str, Any], main: dict[str, str]) -> int | None:
    """How specifically a paper's method fits a run (its number of bracketed settings), or None if it does not:
    the spec must be the run's, each bracketed setting the run's, and each of the paper's ``main`` settings
    that the run's policy has (not overridden by a bracket) the run's too."""
    spec, params = split_method(method)
    if spec != policy or any(key not in settings for key in params):
        return None
    expected = {**main_for(main, policy), **params}
    if any(key in settings and not same_setting(settings[key], value) for key, value in expected.items()):
        return None
    return len(params)


def main_for(main: dict[str, str], policy: str) -> dict[str, str]:
    """The paper's main settings that apply to ``policy``: unscoped keys, and ``SPEC:key`` ones of its spec."""
    scoped = {key.partition(":")[2]: value for key, value in main.items() if key.partition(":")[0] == policy}
    return {**{key: value for key, value in main.items() if ":" not in key}, **scoped}


def own_method(policy: str, settings: dict[str, Any], main: dict[str, str]) -> str:
    """A run's policy spec with, in brackets, the paper's varied settings where the run differs from the main ones."""
    differ = [
        f"{key}={settings[key]}"
        for key, value in main_for(main, policy).items()
        if key in settings and not same_setting(settings[key], value)
    ]
    return f"{policy}[{','.join(differ)}]" if differ else policy


def setting_difference(first: str, second: str) -> str:
    """``window=32 vs 64`` for the settings (JSON) in which two runs differ."""
    a, b = json.loads(first), json.loads(second)
    return ", ".join(f"{key}={a.get(key)} vs {b.get(key)}" for key in sorted({*a, *b}) if a.get(key) != b.get(key))


def budget_fits(paper_budget: str, policy: str, budget: str) -> bool:
    """The paper's ``full`` rows take full-cache runs of any budget; other budgets compare by value."""
    if paper_budget == "full" or policy == "full":
        return paper_budget == "full" and policy == "full"
    try:
        theirs, ours = Budget.parse(paper_budget), Budget.parse(budget)
    except KVBenchError:  # ``all`` / ``na``: rows no single run fills
        return False
    return replace(theirs, spec="") == replace(ours, spec="")  # by value: 2k is 2048


def measured_cells(runs: list[Run]) -> pd.DataFrame:
    """Everything our runs measured, by the names paper tables use: one row per (run key, cell)."""
    full_ppl = {
        (run.metrics["model"], run.data, run.context): run.metrics["scores"]["ppl"]
        for run in runs
        if run.metrics["policy"] == "full" and "ppl" in run.metrics["scores"]
    }
    rows: list[dict[str, Any]] = []
    for run in runs:
        key = {
            "model": run.metrics["model"],
            "policy": run.metrics["policy"],
            "budget": run.metrics["budget"],
            "settings": json.dumps(run.settings, sort_keys=True, default=str),
        }
        scores = run.metrics["scores"]
        cells = {ALIASES.get((run.task, name), name): value for name, value in scores.items()}
        if run.metrics.get("average") is not None:
            cells.setdefault(run.task, scores.get("overall", run.metrics["average"]))
        if "ppl" in cells and (run.metrics["model"], run.data, run.context) in full_ppl:
            cells["ppl_gap"] = cells["ppl"] - full_ppl[(run.metrics["model"], run.data, run.context)]
        if run.context is not None:
            cells.update({f"{name}@{context_label(run.context)}": value for name, value in list(cells.items())})
        rows.extend({**key, "task": task, "value": value} for task, value in cells.items() if value is not None)
    return pd.DataFrame(rows, columns=["model", "policy", "budget", "settings", "task", "value"]).drop_duplicates(
        ["model", "policy", "budget", "settings", "task"]
    )


def assign_rows(
    paper: pd.DataFrame, ours: pd.DataFrame, main: dict[str, str]
) -> dict[tuple[str, str, str, str], tuple | None]:
    """Each of our run keys (model, policy, budget, settings) → the paper row (model, method, budget) it fits
    most specifically (:func:`method_fit` with the paper's ``main`` settings), or None."""
    rows = list(paper[KEY].drop_duplicates().itertuples(index=False, name=None))
    assignment = {}
    for model, policy, budget, settings in (
        ours[["model", "policy", "budget", "settings"]].drop_duplicates().itertuples(index=False, name=None)
    ):
        fits = []
        for row in rows:
            if row[0] != model or not budget_fits(row[2], policy, budget):
                continue
            fit = method_fit(row[1], policy, json.loads(settings), main)
            if fit is not None:
                fits.append((fit, row))
        assignment[(model, policy, budget, settings)] = max(fits)[1] if fits else None
    return assignment


def decimals(value: float) -> int:
    """Decimal places a printed number needs (at least 2, at most 3)."""
    return next((places for places in (2, 3) if round(value, places) == value), 3)


def printed_number(value: float, places: int) -> str:
    """A paper's number as printed: at least ``places`` decimals, tiny ratios (1.6e-4) in scientific form."""
    if value != 0 and abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.{max(places, decimals(value))}f}"


class Comparison:
    """A paper table and the cells our runs measured for it."""

    def __init__(self, paper: str, table: str, runs: list[Run]):
        self.paper, self.table = paper, table
        self.rows = load_table(paper, table)
        self.scale = SCALES.get((paper, table), 1.0)
        self.places = 3 if self.scale != 1.0 else 2
        self.tasks = list(dict.fromkeys(self.rows["task"]))
        source = AVERAGED_TASKS.get((paper, table))
        averaged = load_table(*source)["task"] if source else pd.Series(self.tasks)
        self.averaged = [task for task in dict.fromkeys(averaged) if task not in AGGREGATES]
        self.printed = {
            (m, me, b, t): v for m, me, b, t, v in self.rows[[*KEY, "task", "value"]].itertuples(index=False, name=None)
        }
        cells = measured_cells(runs)
        cells = cells[cells["task"].isin({*self.tasks, *self.averaged})]
        main = MAIN_SETTINGS.get(paper, {})
        self.assignment = assign_rows(self.rows, cells, main)
        self.ours: dict[tuple, dict[str, float]] = {}
        self.own: dict[tuple, dict[str, float]] = {}
        filled: dict[tuple, str] = {}  # (row, task) -> the settings of the run that filled it
        for model, policy, budget, settings, task, value in cells.itertuples(index=False, name=None):
            row = self.assignment[(model, policy, budget, settings)]
            key = row or (model, own_method(policy, json.loads(settings), main), "full" if policy == "full" else budget)
            if filled.setdefault((key, task), settings) != settings:
                raise KVBenchError(
                    f"two runs fill {paper}:{table} {' '.join(key)} {task} with different settings "
                    f"({setting_difference(filled[(key, task)], settings)}); compare their run directories separately"
                )
            (self.ours if row else self.own).setdefault(key, {}).setdefault(task, value * self.scale)

    def constituents(self, model: str, method: str, budget: str, task: str) -> list[tuple[str, str, str, str]]:
        """The cells an aggregate cell averages: the printed ones of its row (budget ``all``: of every budget), or
        for a row that prints only averages, each averaged task (itself only, for an ordinary cell)."""
        if task not in AGGREGATES and budget != "all":
            return [(model, method, budget, task)]
        printed = [
            cell
            for cell in self.printed
            if cell[0] == model
            and cell[1] == method
            and cell[3] not in AGGREGATES
            and (budget == "all" or cell[2] == budget)
        ]
        return printed or [(model, method, budget, averaged) for averaged in self.averaged]

    def measured(self, model: str, method: str, budget: str, task: str) -> tuple[float | None, bool]:
        """Our value for a paper cell and whether it is complete (an average over all the cells it covers)."""
        parts = self.constituents(model, method, budget, task)
        if len(parts) == 1:
            return self.ours.get((model, method, budget), {}).get(task), True
        values = [self.ours.get(cell[:3], {}).get(cell[3]) for cell in parts]
        found = [value for value in values if value is not None]
        if not found:
            return None, True
        return sum(found) / len(found), len(found) == len(values)

    @cached_property
    def notes(self) -> tuple[dict[tuple[str, str, str], list[int]], list[str]]:
        """The transcription notes of the paper's rows (kvbench/papers/README.md): each row's note numbers, and
        the texts, numbered from 1 in the order they first appear."""
        numbered: dict[tuple[str, str, str], list[int]] = {}
        texts: list[str] = []
        for model, method, budget, note in self.rows[[*KEY, "note"]].itertuples(index=False, name=None):
            if note:
                if note not in texts:
                    texts.append(note)
                numbers = numbered.setdefault((model, method, budget), [])
                if texts.index(note) + 1 not in numbers:
                    numbers.append(texts.index(note) + 1)
        return numbered, texts

    @cached_property
    def frame(self) -> pd.DataFrame:
        """The comparison: paper / ours / Δ rows per paper row (the paper row marked with its notes' numbers),
        then rows of ours only."""
        lines = []
        for model, method, budget in dict.fromkeys(self.rows[KEY].itertuples(index=False, name=None)):
            printed, ours, delta = {}, {}, {}
            for task in self.tasks:
                paper_value = self.printed.get((model, method, budget, task))
                printed[task] = "–" if paper_value is None else printed_number(paper_value, self.places)
                value, complete = self.measured(model, method, budget, task)
                if value is None:
                    ours[task] = "–" if paper_value is None else NOT_RUN
                else:
                    ours[task] = f"{value:.{self.places}f}" + ("" if complete else PARTIAL)
                delta[task] = (
                    f"{value - paper_value:+.{self.places}f}"
                    if value is not None and complete and paper_value is not None
                    else ""
                )
            key = {"model": model, "method": method, "budget": budget}
            marks = "".join(f" [{number}]" for number in self.notes[0].get((model, method, budget), []))
            lines += [{**key, "row": f"paper{marks}", **printed}, {**key, "row": "ours", **ours}]
            if any(cell not in (NOT_RUN, "–") for cell in ours.values()):
                lines.append({**key, "row": "Δ", **delta})
        order = sorted(self.own, key=lambda key: (key[0], policy_key(key[1]), budget_key(key[2])))
        for model, policy, budget in order:
            values, cells = self.own[(model, policy, budget)], {}
            for task in self.tasks:
                if task in AGGREGATES and task not in values:
                    found = [values[t] for t in self.averaged if t in values]
                    cells[task] = f"{sum(found) / len(found):.{self.places}f}{PARTIAL}" if found else "–"
                else:
                    cells[task] = f"{values[task]:.{self.places}f}" if task in values else "–"
            lines.append({"model": model, "method": policy, "budget": budget, "row": "ours", **cells})
        frame = pd.DataFrame(lines, columns=[*KEY, "row", *self.tasks])
        headers = {name: header for layout in tabled_tasks().values() for name, header in layout.headers.items()}
        return frame.rename(columns={**headers, "avg": "Avg."})

    def summary(self) -> str:
        """Footnotes and how many of the paper's rows our runs filled."""
        paper_rows = self.rows[KEY].drop_duplicates()
        matched = sum(1 for row in paper_rows.itertuples(index=False, name=None) if row in self.ours)
        lines = [f"paper rows: {len(paper_rows)}, with our values: {matched}; rows of ours only: {len(self.own)}"]
        lines = [f"[{number}] {text}" for number, text in enumerate(self.notes[1], 1)] + lines
        if self.frame.map(lambda cell: str(cell).endswith(PARTIAL)).any(axis=None):
            lines.insert(0, f"{PARTIAL} mean over the cells we ran, not all the cells the paper averaged")
        if self.scale != 1.0:
            lines.insert(0, f"our scores are scaled by {self.scale:g} to the paper's scale")
        return "\n".join(lines)


def compare_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="kvbench compare-paper", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("table", help="PAPER:TABLE, e.g. caote:table2 (see kvbench/papers/README.md)")
    parser.add_argument("run_dirs", nargs="*", help="run directories, or folders holding them")
    parser.add_argument("--format", default="markdown", help="markdown (default), csv, latex")
    parser.add_argument(
        "--output-dir", type=Path, help="also write the comparison to DIR/compare_<paper>_<table>.<md|csv|tex>"
    )
    options = parser.parse_args(args)
    choose("format", options.format, FORMATS)
    paper, table = table_spec(options.table)
    runs = load_runs(options.run_dirs) if options.run_dirs else []
    comparison = Comparison(paper, table, runs)
    text = render(comparison.frame, options.format)
    print(f"\n## {paper}:{table} — {table_caption(paper, table)}\n")
    print(text.rstrip("\n"))
    print(f"\n{comparison.summary()}")
    if options.output_dir:
        for path in write_tables({f"compare_{paper}_{table}": text}, options.output_dir, options.format):
            print(f"wrote {path}")


__all__ = ["Comparison", "compare_main", "measured_cells", "table_spec"]
