"""Run directories into tables, paper comparisons, plots and W&B runs (kvbench.results)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.errors import KVBenchError
from kvbench.finished import load_runs
from kvbench.results.compare import Comparison, table_spec
from kvbench.results.plots import make_plots, niah_grid
from kvbench.results.render import render
from kvbench.results.table import benchmark_tables
from kvbench.rundir import RunDir
from tests.helpers import refused

LONGBENCH = [
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
]


def write_run(
    path: Path,
    model: str,
    policy: str,
    budget: str,
    task: str,
    scores: dict[str, float],
    task_cfg: dict | None = None,
    policy_cfg: dict | None = None,
    records: list[dict] | None = None,
    regime: str = "oneshot",
) -> Path:
    """A finished run directory as ``kvbench run`` writes it (config.yaml, metrics.json, predictions.jsonl)."""
    path.mkdir(parents=True)
    config = {
        "model": {"name": model},
        "policy": {"name": policy, **(policy_cfg or {})},
        "budget": {"spec": budget},
        "task": {"name": task, **(task_cfg or {})},
        "engine": {"regime": regime},
    }
    (path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    average = scores["ppl"] if "ppl" in scores else sum(scores.values()) / len(scores)
    records = records or [{"id": f"{name}-0", "subtask": name, "score": value / 100} for name, value in scores.items()]
    metrics = {
        "model": model,
        "policy": policy,
        "budget": budget,
        "task": task,
        "regime": regime,
        "scores": scores,
        "average": average,
        "num_samples": len(records),
        "kv_cache": {
            "after_prefill_tokens_per_layer": [64, 64],
            "peak_tokens_per_layer": [80, 80],
            "peak_bytes": 100,
            "full_bytes": 400,
        },
        "timing": {"prefill_seconds": 1.0, "decode_seconds": 2.0, "total_seconds": 3.0},
    }
    (path / "metrics.json").write_text(json.dumps(metrics))
    (path / "predictions.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# --- tables ------------------------------------------------------------------------------------------------


def test_longbench_category_table_averages(tmp_path):
    scores = {
        "narrativeqa": 10.0,
        "qasper": 20.0,
        "hotpotqa": 30.0,
        "2wikimqa": 50.0,
        "gov_report": 40.0,
        "trec": 60.0,
        "triviaqa": 80.0,
        "passage_count": 5.0,
        "lcc": 70.0,
        "repobench-p": 50.0,
    }
    write_run(tmp_path / "a", "smollm2_135m", "snapkv", "128", "longbench", scores)
    write_run(tmp_path / "b", "smollm2_135m", "full", "128", "longbench", {"narrativeqa": 30.0, "lcc": 90.0})
    tables = benchmark_tables(load_runs([tmp_path]))
    assert set(tables) == {"longbench", "longbench_categories", "runs"}
    by_category = tables["longbench_categories"].set_index("policy")
    snap = by_category.loc["snapkv"]
    assert snap["Single-Doc QA"] == pytest.approx(15.0)
    assert snap["Multi-Doc QA"] == pytest.approx(40.0)
    assert snap["Summarization"] == pytest.approx(40.0)
    assert snap["Few-shot"] == pytest.approx(70.0)
    assert snap["Synthetic"] == pytest.approx(5.0)
    assert snap["Code"] == pytest.approx(60.0)
    assert snap["Avg."] == pytest.approx(41.5)  # the mean of the ten task scores, not of the categories
    assert by_category.loc["full", "Avg."] == pytest.approx(60.0)
    assert list(tables["longbench"]["policy"]) == ["full", "snapkv"]  # full cache first
    by_task = tables["longbench"]
    assert list(by_task.columns[4:]) == [
        "NrtvQA",
        "Qasper",
        "HotpotQA",
        "2WikiMQA",
        "GovReport",
        "TREC",
        "TriviaQA",
        "PCount",
        "Lcc",
        "RB-P",
        "Avg.",
    ]


def test_ruler_niah_and_ppl_layouts(tmp_path):
    for context in (4096, 8192):
        for budget, value in (("80", 40.0), ("160", 60.0)):
            write_run(
                tmp_path / f"r{context}-{budget}",
                "llama31_8b",
                "h2o",
                budget,
                "ruler",
                {"niah_single_2": value + context / 1024},
                task_cfg={"context_length": context},
            )
    write_run(
        tmp_path / "full",
        "smollm2_135m",
        "full",
        "128",
        "ppl",
        {"ppl": 10.0, "nll": 2.3},
        task_cfg={"path": "/data/book.txt", "max_tokens": 512},
        regime="streaming",
    )
    write_run(
        tmp_path / "sink",
        "smollm2_135m",
        "sink",
        "64",
        "ppl",
        {"ppl": 12.5, "nll": 2.5},
        task_cfg={"path": "/data/book.txt", "max_tokens": 512},
        regime="streaming",
    )
    tables = benchmark_tables(load_runs([tmp_path]))
    assert set(tables) == {"ruler", "ppl", "runs"}  # RULER's NIAH subtasks once: in the RULER table
    ruler = tables["ruler"].set_index(["context", "budget"])["niah_single_2"]
    assert (ruler[4096, "80"], ruler[8192, "160"]) == (44.0, 68.0)
    assert len(tables["runs"]) == 6 and "niah_single_2" not in tables["runs"].columns
    ppl = tables["ppl"].set_index("policy")
    assert ppl.loc["full", "budget"] == "–"
    assert ppl.loc["sink", "ppl_gap"] == pytest.approx(2.5) and ppl.loc["full", "ppl_gap"] == 0
    assert ppl.loc["sink", "data"] == "book"
    for fmt, marker in (("markdown", "| llama31_8b"), ("csv", "llama31_8b,"), ("latex", "\\begin{tabular}")):
        assert marker in render(tables["ruler"], fmt)


def test_table_command_writes_files(tmp_path, capsys):
    write_run(
        tmp_path / "runs" / "a",
        "smollm2_135m",
        "snapkv",
        "128",
        "ruler",
        {"niah_single_1": 50.0},
        task_cfg={"context_length": 1024},
    )
    main(["table", str(tmp_path / "runs"), "--format", "latex", "--output-dir", str(tmp_path / "out")])
    assert "\\begin{tabular}" in capsys.readouterr().out
    assert "50.00" in (tmp_path / "out" / "ruler.tex").read_text()
    error = refused(capsys, ["table", str(tmp_path / "runs"), "--layout", "ppl"])
    assert error.startswith("kvbench: error: no runs fit the 'ppl' layout")


def test_table_lists_run_dirs_it_leaves_out(tmp_path, capsys):
    """Finished runs go into the tables; a run without metrics.json, one whose metrics.json cannot be read, one
    whose config.yaml or predictions contradict its metrics are listed below them with the reason (hidden folders
    and a run directory's wandb/ are not run directories)."""
    write_run(
        tmp_path / "a",
        "smollm2_135m",
        "snapkv",
        "128",
        "ruler",
        {"niah_single_1": 50.0},
        task_cfg={"context_length": 1024},
    )
    (tmp_path / "a" / "wandb" / "files").mkdir(parents=True)
    (tmp_path / "a" / "wandb" / "files" / "config.yaml").write_text("{}")
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "config.yaml").write_text("{}")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metrics.json").write_text("{")
    (tmp_path / ".submitit" / "1_0").mkdir(parents=True)
    (tmp_path / ".submitit" / "1_0" / "config.yaml").write_text("{}")
    relabelled = write_run(tmp_path / "relabelled", "smollm2_135m", "snapkv", "128", "ruler", {"niah_single_1": 50.0})
    config = json.loads((relabelled / "config.yaml").read_text())
    (relabelled / "config.yaml").write_text(json.dumps({**config, "budget": {"spec": "256"}}))
    short = write_run(tmp_path / "short", "smollm2_135m", "h2o", "128", "ruler", {"niah_single_1": 50.0})
    (short / "predictions.jsonl").write_text("")
    main(["table", str(tmp_path)])
    out = capsys.readouterr().out
    below = out[out.index("not in the tables") :].splitlines()
    assert below == [
        "not in the tables: 4 run directories",
        f"  {tmp_path / 'broken'}: cannot read its files (JSONDecodeError: Expecting property name "
        f"enclosed in double quotes: line 1 column 2 (char 1))",
        f"  {tmp_path / 'failed'}: no metrics.json (unfinished or failed)",
        f"  {relabelled}: metrics.json is of budget 128, config.yaml of budget 256",
        f"  {short}: metrics.json counts 1 samples, predictions.jsonl holds 0",
    ]
    assert "50.00" in out


def test_records_are_read_by_id(tmp_path):
    """A repeated id (two writers, or a resumed run that rewrote a sample) counts once; repair rewrites the file
    with one line per id."""
    run_dir = RunDir(tmp_path)
    lines = [{"id": i, "subtask": "t", "score": score} for i, score in (("a", 1), ("b", 0), ("a", 0))]
    run_dir.predictions_path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"id": "c", "sc')
    assert run_dir.records() == lines[:2]
    run_dir.repair()
    assert run_dir.predictions_path.read_text().splitlines() == [json.dumps(line) for line in lines[:2]]


def test_run_dir_lock_refuses_a_second_writer_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom kvbench.rundir import RunDir\n"
            f"run_dir = RunDir({str(tmp_path)!r})\n"
            "with run_dir.lock():\n    run_dir.claim()\n    print('locked', flush=True)\n"
            "    time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    assert holder.stdout.readline() == "locked\n"
    run_dir = RunDir(tmp_path)
    assert run_dir.locked()
    with pytest.raises(KVBenchError, match=f"run directory {tmp_path} is being written by process {holder.pid} on "):
        with run_dir.lock():
            pass
    holder.send_signal(signal.SIGKILL)  # as Slurm kills a cancelled job: no cleanup runs
    holder.wait()
    assert not run_dir.locked()
    with run_dir.lock():
        assert run_dir.locked()  # flock is per open file: this process's probe sees its own lock
        run_dir.claim()
        assert run_dir.lock_path.read_text().startswith(f"process {os.getpid()} on ")
    assert run_dir.lock_path.read_text() == ""  # the name goes with the lock


# --- paper comparison --------------------------------------------------------------------------------------


def test_compare_caote_table2_shows_paper_not_run_and_our_rows(tmp_path, capsys):
    write_run(tmp_path / "snap", "smollm2_135m", "snapkv", "128", "longbench", {"multi_news": 12.5, "trec": 30.0})
    write_run(tmp_path / "full", "smollm2_135m", "full", "128", "longbench", {"multi_news": 14.0, "trec": 40.0})
    main(["compare-paper", "caote:table2", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    header = rows[0]
    assert header[:4] == ["model", "method", "budget", "row"] and header[-1] == "Avg." and len(header) == 4 + 17
    index = rows.index(next(row for row in rows if row[:4] == ["llama31_8b", "full", "full", "paper"]))
    paper_full, ours_full = dict(zip(header, rows[index])), rows[index + 1]
    assert paper_full["Avg."] == "49.20" and paper_full["NrtvQA"] == "30.05"  # as printed in the paper
    assert ours_full[3] == "ours" and ours_full[4:] == ["not run"] * 17
    mine = {row[1]: dict(zip(header, row)) for row in rows if row[0] == "smollm2_135m"}
    assert set(mine) == {"full", "snapkv"} and mine["snapkv"]["row"] == "ours"
    assert (mine["snapkv"]["MultiNews"], mine["snapkv"]["TREC"], mine["snapkv"]["NrtvQA"]) == ("12.50", "30.00", "–")
    assert mine["snapkv"]["Avg."] == "21.25*"  # the mean of the two tasks run, marked partial
    assert "paper rows: 38, with our values: 0; rows of ours only: 2" in out


def test_compare_matches_model_method_budget_and_settings(tmp_path):
    paper = Comparison("caote", "table2", [])
    h2o_2k = paper.rows.query("model == 'llama31_8b' and method == 'h2o' and budget == '2k'").set_index("task")["value"]
    scores = {task: h2o_2k[task] + 1.0 for task in LONGBENCH}
    write_run(tmp_path / "h2o", "llama31_8b", "h2o", "2048", "longbench", scores, regime="chunked")
    frame = Comparison("caote", "table2", load_runs([tmp_path])).frame
    rows = frame[(frame["model"] == "llama31_8b") & (frame["method"] == "h2o") & (frame["budget"] == "2k")]
    assert list(rows["row"]) == ["paper", "ours", "Δ"]
    ours, delta = rows.iloc[1], rows.iloc[2]
    assert ours["NrtvQA"] == f"{h2o_2k['narrativeqa'] + 1:.2f}" and delta["NrtvQA"] == "+1.00"
    assert (
        ours["Avg."] == f"{sum(scores.values()) / 16:.2f}"
        and delta["Avg."] == f"{sum(scores.values()) / 16 - 16.89:+.2f}"
    )

    # OBCache Table 3: a gqa=sum run fills the "[gqa=sum]" row, a gqa=repeat run the plain (SnapKV-layout) row
    write_run(
        tmp_path / "sum",
        "llama31_8b",
        "h2o",
        "80",
        "ruler",
        {"niah_single_2": 70.0},
        task_cfg={"context_length": 8192},
        policy_cfg={"gqa": "sum"},
    )
    write_run(
        tmp_path / "rep",
        "llama31_8b",
        "h2o",
        "80",
        "ruler",
        {"niah_single_2": 11.0},
        task_cfg={"context_length": 8192},
        policy_cfg={"gqa": "repeat"},
    )
    frame = Comparison("obcache", "table3", load_runs([tmp_path / "sum", tmp_path / "rep"])).frame
    frame = frame[frame["budget"] == "80"].set_index(["method", "row"])
    assert frame.loc[("h2o[gqa=sum]", "ours"), "niah_single_2@8k"] == "70.00"
    assert frame.loc[("h2o[gqa=sum]", "Δ"), "niah_single_2@8k"] == "+2.00"  # paper: 68.0
    assert frame.loc[("h2o", "ours"), "niah_single_2@8k"] == "11.00"


def test_compare_scales_and_aggregates(tmp_path):
    # CAOTE Table 5 prints needle accuracy on 0-1: our 0-100 score of task niah is scaled
    write_run(tmp_path / "niah", "llama32_3b", "h2o+caote", "2k", "niah", {"overall": 40.0, "4096": 40.0})
    frame = Comparison("caote", "table5", load_runs([tmp_path / "niah"])).frame
    row = frame[(frame["model"] == "llama32_3b") & (frame["method"] == "h2o+caote") & (frame["budget"] == "2k")]
    assert row.iloc[1]["niah"] == "0.400"
    # CAOTE Table 4: the PPL gap to the full cache of the same model and text
    for policy, ppl in (("full", 8.0), ("tova", 8.75)):
        write_run(
            tmp_path / f"ppl-{policy}",
            "llama31_8b",
            policy,
            "4k",
            "booksum",
            {"ppl": ppl, "nll": 2.0},
            task_cfg={"max_tokens": 8192},
        )
    frame = Comparison("caote", "table4", load_runs([tmp_path / "ppl-full", tmp_path / "ppl-tova"])).frame
    tova = frame[(frame["model"] == "llama31_8b") & (frame["method"] == "tova") & (frame["budget"] == "4k")]
    assert tova.iloc[1]["ppl_gap"] == "0.75"
    # OBCache Table 1: the Avg. over all budgets (budget "all") is the mean of every cell, "*" when partial
    write_run(
        tmp_path / "t1", "llama31_8b", "tova", "80", "ruler", {"niah_single_2": 50.0}, task_cfg={"context_length": 4096}
    )
    frame = Comparison("obcache", "table1", load_runs([tmp_path / "t1"])).frame
    avg = frame[(frame["method"] == "tova") & (frame["budget"] == "all")].iloc[1]["Avg."]
    assert avg == "50.00*"


CALIDROP_TASKS = [
    "multifieldqa_en",
    "qasper",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
]


def test_an_unbracketed_row_takes_only_the_papers_main_settings(tmp_path):
    """CaliDrop: the default run (θ1 0.7, θ2 0.85) fills Table 1's snapkv+calidrop row and Table 2's [0.70, 0.85]
    row; a θ-sweep run, whose directory sorts first, fills only its own Table 2 row."""
    snap = dict(window=32, pool="avg", kernel=5)
    sweep = write_run(
        tmp_path / "policy.theta1=0.6,policy.theta2=0.8,policy=snapkv+calidrop",
        "llama3_8b",
        "snapkv+calidrop",
        "128",
        "longbench",
        {task: 11.0 for task in CALIDROP_TASKS},
        policy_cfg={**snap, "theta1": 0.6, "theta2": 0.8},
    )
    default = write_run(
        tmp_path / "policy=snapkv+calidrop",
        "llama3_8b",
        "snapkv+calidrop",
        "128",
        "longbench",
        {task: 22.0 for task in CALIDROP_TASKS},
        policy_cfg={**snap, "theta1": 0.7, "theta2": 0.85},
    )
    runs = load_runs([tmp_path])
    assert [run.run_dir.path for run in runs] == [sweep, default]  # the sweep run comes first
    table1 = Comparison("calidrop", "table1", runs).frame.set_index(["model", "method", "budget", "row"])
    assert table1.loc[("llama3_8b", "snapkv+calidrop", "128", "ours"), "Qasper"] == "22.00"
    assert table1.loc[("llama3_8b", "snapkv+calidrop", "128", "ours"), "Avg."] == "22.00"
    # the sweep run fills no paper row: it follows them as a row of ours, labelled with its thresholds
    assert table1.loc[("llama3_8b", "snapkv+calidrop[theta1=0.6,theta2=0.8]", "128", "ours"), "Qasper"] == "11.00"
    table2 = Comparison("calidrop", "table2", runs).frame.set_index(["method", "row"])
    assert table2.loc[("snapkv+calidrop[theta1=0.60,theta2=0.80]", "ours"), "Qasper"] == "11.00"
    assert table2.loc[("snapkv+calidrop[theta1=0.70,theta2=0.85]", "ours"), "Qasper"] == "22.00"
    assert table2.loc[("snapkv+calidrop[theta1=0.65,theta2=0.80]", "ours"), "Qasper"] == "not run"


def test_runs_outside_the_papers_rows_keep_their_varied_settings_and_conflicts_are_errors(tmp_path):
    for theta1, score in ((0.6, 1.0), (0.7, 2.0)):
        write_run(
            tmp_path / f"t{theta1}",
            "smollm2_135m",
            "snapkv+calidrop",
            "64",
            "longbench",
            {"qasper": score},
            policy_cfg={"window": 32, "theta1": theta1, "theta2": 0.85},
        )
    own = Comparison("calidrop", "table1", load_runs([tmp_path])).frame.query("model == 'smollm2_135m'")
    assert dict(zip(own["method"], own["Qasper"])) == {"snapkv+calidrop[theta1=0.6]": "1.00", "snapkv+calidrop": "2.00"}
    write_run(
        tmp_path / "w64",
        "smollm2_135m",
        "snapkv+calidrop",
        "64",
        "longbench",
        {"qasper": 3.0},
        policy_cfg={"window": 64, "theta1": 0.7, "theta2": 0.85},
    )
    with pytest.raises(
        KVBenchError,
        match=r"two runs fill calidrop:table1 smollm2_135m snapkv\+calidrop 64 qasper with "
        r"different settings \(window=32 vs 64\)",
    ):
        Comparison("calidrop", "table1", load_runs([tmp_path]))


def test_defaults_of_obcache_and_slake_tables(tmp_path):
    """OBCache Table 4's plain rows take gqa=repeat runs only; SLAKE Table 2 (averages only) fills from the 16 tasks
    of Table 1, the run without VABS (layer_budget=cake) in its ablation row and never in Table 1's SLAKE row."""
    write_run(
        tmp_path / "ob-sum", "llama31_8b", "h2o", "10pct", "longbench", {"qasper": 5.0}, policy_cfg={"gqa": "sum"}
    )
    write_run(
        tmp_path / "ob-rep", "llama31_8b", "h2o", "10pct", "longbench", {"qasper": 7.0}, policy_cfg={"gqa": "repeat"}
    )
    table4 = Comparison("obcache", "table4", load_runs([tmp_path / "ob-sum", tmp_path / "ob-rep"])).frame
    assert table4.set_index(["method", "budget", "row"]).loc[("h2o", "10pct", "ours"), "Qasper"] == "7.00"
    for policy, layer_budget, score in (
        ("cake", "cake", 28.0),
        ("cake+slake", "cake", 29.0),
        ("cake+slake", "vabs", 30.0),
    ):
        settings = {"layer_budget": {"name": layer_budget}}
        write_run(
            tmp_path / "slake" / f"{policy}-{layer_budget}",
            "llama2_7b_chat",
            policy,
            "128",
            "longbench",
            {task: score + (1.0 if task == "qasper" else 0.0) for task in LONGBENCH},
            policy_cfg=settings,
        )
    runs = load_runs([tmp_path / "slake"])
    table2 = Comparison("slake", "table2", runs).frame.set_index(["method", "row"])
    for method, score in (("cake", 28.0), ("cake+slake[layer_budget=cake]", 29.0), ("cake+slake", 30.0)):
        assert table2.loc[(method, "ours"), "Avg."] == f"{score + 1 / 16:.2f}"  # complete: all 16 tasks
    assert table2.loc[("cake+slake", "Δ"), "Avg."] == f"{30.0 + 1 / 16 - 29.76:+.2f}"
    table1 = Comparison("slake", "table1", runs).frame.set_index(["model", "method", "budget", "row"])
    assert table1.loc[("llama2_7b_chat", "cake+slake", "128", "ours"), "Qasper"] == "31.00"
    write_run(tmp_path / "part", "llama2_7b_chat", "cake", "128", "longbench", {"qasper": 10.0, "trec": 20.0})
    partial = Comparison("slake", "table2", load_runs([tmp_path / "part"])).frame.set_index(["method", "row"])
    assert partial.loc[("cake", "ours"), "Avg."] == "15.00*"


def test_calidrop_needle_text_compares_with_the_overall_needle_score(tmp_path):
    """The H2O 48.5 -> 83.8 quoted at KV 96 and 128: a niah run's overall score fills the row of its budget."""
    for policy, budget, overall in (("h2o", "96", 50.0), ("h2o+calidrop", "128", 80.0)):
        write_run(
            tmp_path / f"{policy}-{budget}", "llama3_8b", policy, budget, "niah", {"overall": overall, "8000": overall}
        )
    assert table_spec("calidrop:niah_text") == ("calidrop", "niah_text")
    frame = Comparison("calidrop", "niah_text", load_runs([tmp_path])).frame.set_index(["method", "budget", "row"])
    assert frame.loc[("h2o", "96", "ours"), "niah"] == "50.00" and frame.loc[("h2o", "96", "Δ"), "niah"] == "+1.50"
    assert frame.loc[("h2o+calidrop", "128", "Δ"), "niah"] == "-3.80"
    assert frame.loc[("h2o", "128", "ours"), "niah"] == "not run"


def test_compare_bad_table_is_one_line(capsys):
    error = refused(capsys, ["compare-paper", "caote:table99"])
    assert "unknown table for paper 'caote' 'table99'; valid choices: " in error
    assert table_spec("obcache:1") == ("obcache", "table1")


# --- plots -------------------------------------------------------------------------------------------------


def needle_records(scores: dict[tuple[int, int], float]) -> list[dict]:
    return [
        {"id": f"niah-{length}-{depth}", "subtask": "niah", "score": score, "context_length": length, "depth": depth}
        for (length, depth), score in scores.items()
    ]


def test_niah_grid_and_heatmap(tmp_path):
    cells = {(1024, 0): 1.0, (1024, 50): 0.0, (2048, 0): 0.5, (2048, 50): 1.0}
    grid = niah_grid(needle_records(cells))
    assert list(grid.columns) == [1024, 2048] and list(grid.index) == [0.0, 50.0]
    assert grid.loc[50.0, 1024] == 0.0 and grid.loc[0.0, 2048] == 50.0
    write_run(
        tmp_path / "runs" / "niah",
        "smollm2_135m",
        "snapkv",
        "128",
        "niah",
        {"overall": 62.5},
        records=needle_records(cells),
    )
    paths = make_plots(load_runs([tmp_path / "runs"]), "heatmap", tmp_path / "plots")
    assert [path.name for path in paths] == ["heatmap_smollm2_135m_snapkv@128.png"]
    assert paths[0].read_bytes()[:4] == b"\x89PNG"
    assert benchmark_tables(load_runs([tmp_path / "runs"]))["niah"].iloc[0]["1k/128"] == 50.0


def test_the_full_cache_has_no_budget_and_no_cell_is_shown_that_was_not_run(tmp_path, capsys):
    """Runs at two budgets beside the full cache (run with a budget it ignores): the full cache is labelled
    without one, in every table and plot title, and no cell holds a value its row did not run."""
    cells = {(1024, 0): 1.0, (1024, 50): 0.0, (2048, 0): 0.5, (2048, 50): 1.0}
    for policy, budget in (("full", "128"), ("snapkv", "64"), ("snapkv", "128")):
        write_run(tmp_path / f"{policy}{budget}", "smollm2_135m", policy, budget, "niah", {"overall": 62.5},
                  records=needle_records(cells))  # fmt: skip
    runs = load_runs([tmp_path])
    niah = benchmark_tables(runs)["niah"].set_index("policy")
    averages = ["Avg./64", "Avg./128", "Avg./–"]  # one per budget: budgets are never averaged together
    assert list(niah.columns[3:]) == ["1k/64", "1k/128", "1k/–", "2k/64", "2k/128", "2k/–", *averages]
    assert niah.loc["full", ["1k/64", "1k/128", "2k/64", "2k/128", "Avg./64", "Avg./128"]].isna().all()
    assert (niah.loc["full", "1k/–"], niah.loc["full", "2k/–"], niah.loc["full", "Avg./–"]) == (50.0, 75.0, 62.5)
    assert niah.loc["snapkv", "Avg./64"] == (niah.loc["snapkv", "1k/64"] + niah.loc["snapkv", "2k/64"]) / 2
    assert niah[["1k/–", "2k/–"]].drop(index="full").isna().all().all()
    main(["table", str(tmp_path)])
    out = capsys.readouterr().out
    assert "full@" not in out and "| full " in out
    assert "full@" not in " ".join(path.name for path in make_plots(runs, "heatmap", tmp_path / "plots"))


def test_budget_and_ppl_plots(tmp_path, capsys):
    for budget, value in (("64", 20.0), ("128", 40.0), ("256", 55.0)):
        write_run(
            tmp_path / f"snap{budget}",
            "smollm2_135m",
            "snapkv",
            budget,
            "ruler",
            {"niah_single_1": value},
            task_cfg={"context_length": 1024},
        )
    write_run(
        tmp_path / "full",
        "smollm2_135m",
        "full",
        "64",
        "ruler",
        {"niah_single_1": 60.0},
        task_cfg={"context_length": 1024},
    )
    for policy, shift in (("full", 0.0), ("sink", 0.3)):
        write_run(
            tmp_path / f"ppl-{policy}",
            "smollm2_135m",
            policy,
            "64",
            "ppl",
            {"ppl": 9.0, "nll": 2.2},
            task_cfg={"path": "book.txt", "max_tokens": 256},
            records=[
                {
                    "id": "book-0",
                    "subtask": "book",
                    "score": 9.0,
                    "buckets": {"0": 2.5 + shift, "64": 2.2 + shift, "128": 2.1 + shift},
                }
            ],
        )
    main(["plot", str(tmp_path), "--output-dir", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert "budget_curves.png" in out and "ppl_vs_length.png" in out and "heatmap" not in out
    assert (tmp_path / "plots" / "ppl_vs_length.png").stat().st_size > 1000
    assert "nothing to plot for --kind heatmap" in refused(capsys, ["plot", str(tmp_path), "--kind", "heatmap"])


# --- W&B ---------------------------------------------------------------------------------------------------


def offline_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``: W&B's LevelDB-style log of 32 KiB
    blocks, each record chunk behind a 7-byte header: CRC, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # block trailer
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch, capsys):
    """``logger=wandb`` offline: the run's metrics are in the W&B run directory as a file, at once, and the run
    says where the W&B run went."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    main(
        [
            "run",
            "model=tiny_llama",
            "task=ruler",
            "task.subtasks=[niah_single_1]",
            "task.context_length=640",
            "task.num_samples=1",
            "policy=tova",
            "budget=64",
            "logger=wandb",
            f"output_dir={out}",
        ]
    )
    offline = list((out / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    saved = json.loads((offline[0] / "files" / "kvbench-metrics.json").read_text())
    assert saved == json.loads((out / "metrics.json").read_text())
    assert list((offline[0] / "files" / "media" / "table").glob("predictions_*.table.json"))
    assert f"kvbench: W&B run tiny_llama/ruler/tova@64 logged offline in {offline[0]} (upload it with: wandb sync " in (
        capsys.readouterr().err
    )


@pytest.mark.slow  # reads W&B's offline protobuf log, which is not always flushed when wandb.finish returns
def test_wandb_offline_log_holds_summary_config_and_tags(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    main(
        [
            "run",
            "model=tiny_llama",
            "task=ruler",
            "task.subtasks=[niah_single_1]",
            "task.context_length=640",
            "task.num_samples=1",
            "policy=snapkv",
            "budget=64",
            "logger=wandb",
            "logger.tags=[test]",
            f"output_dir={out}",
        ]
    )
    metrics = json.loads((out / "metrics.json").read_text())
    offline = list((out / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    records = offline_records(next(offline[0].glob("run-*.wandb")))  # what `wandb sync` would upload
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update}
            )
    assert summary["scores/niah_single_1"] == metrics["scores"]["niah_single_1"]
    assert summary["average"] == metrics["average"]
    assert summary["kv_cache/peak_bytes"] == metrics["kv_cache"]["peak_bytes"]
    assert summary["kv_cache/after_prefill_tokens_mean"] == 64
    assert summary["timing/total_seconds"] == pytest.approx(metrics["timing"]["total_seconds"])
    assert summary["predictions/_type"] == "table-file" and summary["predictions/nrows"] == 1
    assert list((offline[0] / "files" / "media" / "table").glob("predictions_*.table.json"))
    run = next(record.run for record in records if record.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["policy"]["name"] == "snapkv" and config["model"]["name"] == "tiny_llama"
    assert "test" in run.tags and run.display_name == "tiny_llama/ruler/snapkv@64"


def test_wandb_mode_without_key_is_offline(monkeypatch, tmp_path):
    from kvbench.results.wandb_logger import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode(None) == "offline"
    assert wandb_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(None) == "offline"


def test_logger_none_writes_no_wandb_dir(tmp_path):
    out = tmp_path / "run"
    main(
        [
            "run",
            "model=tiny_llama",
            "task=ruler",
            "task.subtasks=[niah_single_1]",
            "task.context_length=640",
            "task.num_samples=1",
            "policy=tova",
            "budget=64",
            f"output_dir={out}",
        ]
    )
    assert (out / "metrics.json").exists() and not (out / "wandb").exists()


def test_compare_prints_the_transcription_notes_beside_their_rows(capsys):
    """CAOTE Table 2 prints the Llama 3.1-8B 4k H2O+FastCAOTE and TOVA+FastCAOTE rows identically: each paper
    row carries its note's number, and the note is printed below the table."""
    from kvbench.results.compare import compare_main

    compare_main(["caote:table2"])
    lines = capsys.readouterr().out.splitlines()
    cells = [[cell.strip() for cell in line.split("|")] for line in lines if line.startswith("| llama31_8b")]
    paper = {(row[2], row[3]): row[4] for row in cells if row[4].startswith("paper")}
    h2o, tova = paper["h2o+fastcaote", "4k"], paper["tova+fastcaote", "4k"]
    assert h2o.startswith("paper [") and tova.startswith("paper [") and paper["snapkv+fastcaote", "4k"] == "paper"
    number = h2o.removeprefix("paper [").rstrip("]")
    assert f"[{number}] paper prints this row identical to tova+fastcaote 4k (duplicated row; which is right " in (
        "\n".join(lines)
    )


def test_latex_escapes_names_and_symbols_and_uses_booktabs():
    """Policy and task names with ``_``, the en dash of an empty cell, Δ and − come out as LaTeX that compiles."""
    import pandas as pd

    from kvbench.results.render import render

    table = pd.DataFrame(
        {"policy": ["h2o+obcache_joint", "snapkv 50%"], "Δ vs base": ["−1.0 [−2.0, 0.5]*", "–"], "avg": [1.234, None]}
    )
    text = render(table, "latex")
    assert text.splitlines()[:4] == [
        r"\begin{tabular}{llr}",
        r"\toprule",
        r"policy & $\Delta$ vs base & avg \\",
        r"\midrule",
    ]
    assert r"h2o+obcache\_joint & $-$1.0 [$-$2.0, 0.5]* & 1.23 \\" in text
    assert r"snapkv 50\% & -- & -- \\" in text and text.endswith("\\bottomrule\n\\end{tabular}\n")
    assert all(ord(char) < 128 for char in text)


def test_latex_tables_compile_where_a_tex_engine_is_installed(tmp_path):
    """The leaderboard's and every benchmark layout's tables of the committed runs, rendered as LaTeX and compiled by
    pdflatex (skipped without one)."""
    import shutil
    import subprocess

    from kvbench import PROJECT_ROOT
    from kvbench.finished import load_runs
    from kvbench.results.leaderboard import leaderboard_tables
    from kvbench.results.render import render
    from kvbench.results.table import benchmark_tables

    if shutil.which("pdflatex") is None:
        pytest.skip("no pdflatex on this machine")
    committed = [PROJECT_ROOT / "results" / name for name in ("leaderboard", "shared_context")]
    if not all(path.is_dir() for path in committed):
        pytest.skip("the committed results are absent")
    runs = load_runs(committed)
    tables = [*leaderboard_tables(runs).values(), *benchmark_tables(runs).values()]
    body = "\n\n".join(render(table, "latex") for table in tables)
    (tmp_path / "tables.tex").write_text(
        "\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n" + body + "\n\\end{document}\n"
    )
    done = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "tables.tex"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]


def test_budget_curves_against_the_compression_ratio(tmp_path, capsys):
    """``kvbench plot --x ratio``: each run at the share of the full KV bytes its samples evicted after the prefill
    (kvpress's axis), the full cache at 0; a run whose records say nothing of their KV is left out; ``--x`` takes
    budget or ratio, in one line."""
    from kvbench.finished import load_runs
    from kvbench.results.plots import budget_figure, budget_frame, compression_ratio

    def records(kept: list[int]) -> list[dict]:  # one sample per kept byte count, of 1000 full bytes each
        kv = [{"after_prefill_bytes": bytes_, "full_bytes": 1000} for bytes_ in kept]
        return [{"id": f"s{i}", "subtask": "niah_single_1", "score": 0.5, "kv": one} for i, one in enumerate(kv)]

    for name, budget, kept in (("snap64", "64", [100, 300]), ("snap128", "128", [400, 600]), ("full", "64", [1000])):
        policy = "full" if name == "full" else "snapkv"
        write_run(tmp_path / name, "m", policy, budget, "ruler", {"niah_single_1": 50.0}, records=records(kept))
    write_run(tmp_path / "old", "m", "h2o", "64", "ruler", {"niah_single_1": 40.0})  # records without kv
    assert compression_ratio(records([100, 300])) == pytest.approx(0.8) and compression_ratio([{"id": "x"}]) is None
    frame = budget_frame(load_runs([tmp_path]), "ratio")
    assert dict(zip(frame["policy"] + "@" + frame["budget"], frame["ratio"].round(6))) == {
        "full@64": 0.0,
        "snapkv@128": 0.5,
        "snapkv@64": 0.8,
    }
    (axis,) = budget_figure(frame, "ratio").axes
    assert axis.get_xlabel() == "compression ratio (KV evicted)"
    (curve,) = [line for line in axis.get_lines() if line.get_label() == "snapkv"]
    assert list(curve.get_xdata()) == pytest.approx([0.5, 0.8])
    main(["plot", str(tmp_path), "--kind", "budget", "--x", "ratio", "--output-dir", str(tmp_path / "plots")])
    assert "ratio_curves.png" in capsys.readouterr().out
    assert refused(capsys, ["plot", str(tmp_path), "--x", "tokens"]).startswith(
        "kvbench: error: unknown plot --x 'tokens'; valid choices: budget, bytes, ratio"
    )


def test_budget_curves_against_the_bytes_held_put_every_family_on_one_axis(tmp_path, capsys):
    """``kvbench plot --x bytes``: each run at the mean MiB its samples held — after the prefill, or over the
    generation where the cache evicted while decoding —, labelled as the run is (a quantised cache beside its
    policy)."""
    from kvbench.finished import load_runs
    from kvbench.results.plots import budget_figure, budget_frame, held_mib

    def records(held: list[int], decoding: bool = False) -> list[dict]:  # MiB held after the prefill, or decoding
        def kv(mib: int) -> dict:
            if decoding:  # 4 MiB after the prefill, then the generation's mean
                return {"after_prefill_bytes": 4 * 2**20, "generation": {"mean_bytes": mib * 2**20}}
            return {"after_prefill_bytes": mib * 2**20}

        return [{"id": f"s{i}", "subtask": "niah_single_1", "score": 0.5, "kv": kv(mib)} for i, mib in enumerate(held)]

    write_run(tmp_path / "snap", "m", "snapkv", "0.5x", "ruler", {"niah_single_1": 50.0}, records=records([3, 5]))
    kivi = write_run(tmp_path / "kivi", "m", "snapkv", "0.5x", "ruler", {"niah_single_1": 40.0}, records=records([1]))
    metrics = json.loads((kivi / "metrics.json").read_text())
    (kivi / "metrics.json").write_text(json.dumps({**metrics, "label": "snapkv+kivi2"}))
    write_run(tmp_path / "h2o", "m", "h2o", "0.5x", "ruler", {"niah_single_1": 30.0}, records=records([2, 2], True))
    assert held_mib(records([3, 5])) == 4 and held_mib(records([2, 6], True)) == 4 and held_mib([{"id": "x"}]) is None
    frame = budget_frame(load_runs([tmp_path]), "bytes")
    assert dict(zip(frame["policy"], frame["ratio"])) == {"snapkv": 4, "snapkv+kivi2": 1, "h2o": 2}
    (axis,) = budget_figure(frame, "bytes").axes
    assert axis.get_xlabel() == "KV held per sample (MiB)"
    main(["plot", str(tmp_path), "--kind", "budget", "--x", "bytes", "--output-dir", str(tmp_path / "plots")])
    assert "bytes_curves.png" in capsys.readouterr().out


def test_identical_budget_curves_are_drawn_once_and_named_together():
    """Two policies with the same score at every budget would hide one another: one line, both names."""
    import pandas as pd

    from kvbench.results.plots import budget_figure

    rows = [
        ("snapkv", "64", 50.0), ("snapkv", "128", 75.0), ("pyramidkv", "64", 50.0), ("pyramidkv", "128", 75.0),
        ("h2o", "64", 25.0), ("h2o", "128", 75.0),
    ]  # fmt: skip
    frame = pd.DataFrame(
        [{"model": "m", "task": "ruler", "score": "s", "context": 1024, "policy": p, "budget": b, "value": v}
         for p, b, v in rows]
    )  # fmt: skip
    (axis,) = budget_figure(frame).axes
    assert sorted(line.get_label() for line in axis.get_lines()) == ["h2o", "pyramidkv = snapkv"]


def test_the_runs_table_shows_what_a_sample_cost_where_records_count_it(tmp_path):
    """``kvbench table``'s runs layout: beside each run's average, the mean tokens its samples generated and the mean
    of each sample's most cache (its generation's own peak where it evicts while decoding) and, there, of what it held
    over the generation; a run whose records count neither shows them empty, and the columns go where no run has
    them."""
    mib = 2**20
    records = [
        {"id": "a", "subtask": "gsm8k", "score": 1.0, "generated_tokens": 100, "kv": {"peak_bytes": 4 * mib}},
        {
            "id": "b",
            "subtask": "gsm8k",
            "score": 0.0,
            "generated_tokens": 300,
            "kv": {"peak_bytes": 9 * mib, "generation": {"peak_bytes": 2 * mib, "mean_bytes": 1.5 * mib}},
        },
    ]
    write_run(tmp_path / "r" / "a", "m", "snapkv", "64", "gsm8k", {"gsm8k": 50.0}, records=records)
    write_run(tmp_path / "r" / "b", "m", "h2o", "64", "gsm8k", {"gsm8k": 0.0})
    runs = benchmark_tables(load_runs([tmp_path / "r"]), layout="runs")["runs"].set_index("policy")
    assert runs.loc["snapkv", "generated"] == 200 and runs.loc["snapkv", "kv_peak_mib"] == 3.0
    assert runs.loc["snapkv", "kv_mean_mib"] == 1.5  # over the records whose generation evicted: b's mean
    assert runs.loc["h2o", "generated"] != runs.loc["h2o", "generated"]  # NaN
    write_run(tmp_path / "s" / "b", "m", "h2o", "64", "gsm8k", {"gsm8k": 0.0})
    plain = benchmark_tables(load_runs([tmp_path / "s"]), layout="runs")["runs"]
    assert "generated" not in plain and "kv_peak_mib" not in plain and "kv_mean_mib" not in plain
