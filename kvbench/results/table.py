"""``kvbench table RUN_DIR...``: one row per run (model, task, policy, budget, regime), one column per score."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from kvbench.results.rundir import find_run_dirs

INDEX = ["model", "task", "policy", "budget", "regime"]


def runs_frame(paths: list[str]) -> pd.DataFrame:
    """A long frame: one row per (run, score name) with the run's identifying columns."""
    rows = []
    for run_dir in find_run_dirs(paths):
        metrics = run_dir.metrics()
        identity = {key: metrics.get(key) for key in INDEX}
        kv = metrics.get("kv_cache", {})
        after = kv.get("after_prefill_tokens_per_layer") or [0]
        extra = {"kv_tokens": sum(after) / len(after), "seconds": metrics.get("timing", {}).get("total_seconds")}
        for name, value in {**metrics["scores"], "average": metrics["average"]}.items():
            rows.append({**identity, "score": name, "value": value, **extra, "run_dir": str(run_dir.path)})
    return pd.DataFrame(rows)


def wide_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs as rows, scores as columns (``average`` last), plus mean kept tokens per layer and run time."""
    table = frame.pivot_table(index=INDEX, columns="score", values="value", aggfunc="first", sort=False)
    columns = [column for column in table.columns if column != "average"] + ["average"]
    extras = frame.groupby(INDEX, sort=False)[["kv_tokens", "seconds"]].first()
    return table[columns].join(extras).reset_index()


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvbench table", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", help="run directories, or folders holding them")
    parser.add_argument("--format", choices=["markdown", "csv", "latex"], default="markdown")
    parser.add_argument("--output", type=Path, help="also write the table to this file")
    options = parser.parse_args(args)
    table = wide_table(runs_frame(options.run_dirs))
    render = {
        "markdown": lambda: table.to_markdown(index=False, floatfmt=".2f"),
        "csv": lambda: table.to_csv(index=False),
        "latex": lambda: table.to_latex(index=False, float_format="%.2f"),
    }[options.format]
    text = render()
    print(text)
    if options.output:
        options.output.write_text(text, encoding="utf-8")
