"""The command line end to end on tiny models: run directories, resuming, one-line errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.cli import main
from tests.helpers import refused

RULER = [
    "model=tiny_llama",
    "task=ruler",
    "task.subtasks=[niah_single_1]",
    "task.context_length=640",
    "task.num_samples=2",
]


def kvbench(*args: str) -> None:
    main(list(args))


def read_run(path: Path) -> tuple[dict, list[dict]]:
    metrics = json.loads((path / "metrics.json").read_text())
    records = [json.loads(line) for line in (path / "predictions.jsonl").read_text().splitlines()]
    return metrics, records


@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_run_writes_run_directory(tmp_path, regime):
    out = tmp_path / regime
    kvbench(
        "run",
        *RULER,
        "policy=h2o+obcache_joint",
        "budget=64",
        f"engine.regime={regime}",
        "engine.block_size=64",
        f"output_dir={out}",
    )
    metrics, records = read_run(out)
    assert (out / "config.yaml").exists()
    assert metrics["policy"] == "h2o+obcache_joint" and metrics["budget"] == "64" and metrics["task"] == "ruler"
    assert set(metrics["scores"]) == {"niah_single_1"} and metrics["num_samples"] == 2 == len(records)
    assert metrics["kv_cache"]["after_prefill_tokens_per_layer"] == [64, 64, 64]
    assert metrics["kv_cache"]["peak_bytes"] < metrics["kv_cache"]["full_bytes"]
    if regime == "chunked":
        assert max(metrics["kv_cache"]["peak_tokens_per_layer"]) <= 64 + 64
    assert {"prefill_seconds", "decode_seconds", "total_seconds"} <= set(metrics["timing"])
    assert all({"id", "subtask", "prediction", "answers", "score"} <= set(record) for record in records)


def test_budget_covering_prompt_equals_full(tmp_path):
    kvbench("run", *RULER, "policy=full", f"output_dir={tmp_path / 'full'}")
    kvbench("run", *RULER, "policy=snapkv+caote", "budget=4k", f"output_dir={tmp_path / 'snap'}")
    _, full = read_run(tmp_path / "full")
    _, snap = read_run(tmp_path / "snap")
    assert [r["prediction"] for r in full] == [r["prediction"] for r in snap]


def test_interrupted_run_resumes_without_recomputing(tmp_path):
    out = tmp_path / "run"
    kvbench("run", *RULER, "policy=tova", "budget=32", f"output_dir={out}")
    _, records = read_run(out)
    (out / "metrics.json").unlink()
    lines = (out / "predictions.jsonl").read_text().splitlines()
    (out / "predictions.jsonl").write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    kvbench("run", *RULER, "policy=tova", "budget=32", f"output_dir={out}")
    metrics, resumed = read_run(out)
    assert resumed[0] == records[0]  # same timings: not recomputed
    assert [r["id"] for r in resumed] == [r["id"] for r in records] and metrics["num_samples"] == 2
    assert resumed[1]["prediction"] == records[1]["prediction"]


def test_perplexity_task(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    out = tmp_path / "ppl"
    kvbench(
        "run",
        "model=tiny_llama",
        "task=ppl",
        f"task.path={text}",
        "task.max_tokens=120",
        "policy=sink",
        "budget=32",
        "engine.regime=streaming",
        f"output_dir={out}",
    )
    metrics, records = read_run(out)
    assert set(metrics["scores"]) == {"ppl", "nll"} and metrics["scores"]["ppl"] > 1
    assert metrics["kv_cache"]["peak_tokens_per_layer"] == [33, 33, 33]


@pytest.mark.parametrize(
    "override,message",
    [
        ("policy=h3o", "unknown policy 'h3o'; valid choices: "),
        ("policy=h2o+nope", "unknown policy modifier 'nope'; valid choices: "),
        ("model=gpt5", "unknown model 'gpt5'; valid choices: "),
        ("task=mmlu", "unknown task 'mmlu'; valid choices: "),
        ("engine.regime=batched", "engine.regime=batched: must be one of oneshot, chunked, streaming"),
        ("budget=0", "invalid budget '0'"),
        ("budget=-3", "invalid budget '-3'"),
        (
            "+policy.score_windw=16",
            "unknown key policy.score_windw for policy snapkv; valid keys: gqa, kernel, "
            "layer_budget, name, pool, window",
        ),
        ("policy.score_windw=16", "unknown key policy.score_windw for policy snapkv; valid keys: "),
        ("+compat=cakekv", "unknown key policy.compress_above for policy snapkv; valid keys: "),  # CAKE's profile
        ("+task.contxt_length=8", "unknown key task.contxt_length for task ruler; valid keys: "),
        (
            "engine.regme=oneshot",
            "unknown key engine.regme for the engine; valid keys: batch_size, block_size, decode_evict, ",
        ),
        ("+model.dtyp=float32", "unknown key model.dtyp for model smollm2_135m; valid keys: "),
        (
            "policy.layer_budget.betta=2",
            "unknown key policy.layer_budget.betta for layer budget uniform; valid keys: name",
        ),
        ("foo=1", "unknown key foo for the run config; valid keys: budget, cache, compat, engine, experiment, "),
        ("=3", "'=3' names no setting: write KEY=VALUE, e.g. budget=128"),
        ("hydra/launcher=nope", "Could not find 'hydra/launcher/nope' Available options in 'hydra/launcher': basic"),
        ("hydra.foo=1", "Could not override 'hydra.foo'. To append to your config use +hydra.foo=1 (Key 'foo' not in"),
        ("task._target_=os.system", "task._target_='os.system' is not a task class"),
        ("task._target_=no.such.Task", "task._target_='no.such.Task' is not a task class"),
        ("output_dir=/proc/kvbench", "cannot write /proc/kvbench: No such file or directory; "),
    ],
)
def test_bad_values_exit_with_one_line(override, message, capsys):
    assert message in refused(capsys, ["run", override])


@pytest.mark.parametrize(
    ("model", "policy", "message"),
    [
        ("tiny_gemma3", "cake", "policy.layer_budget=cake shares the budget across every layer, and 2 of this model's"),
        ("tiny_gemma3", "kvzip task.query_mode=agnostic", "its context's reconstruction shares the budget across"),
        ("tiny_gpt_oss", "snapkv+slake", "slake replaces decode attention with its own over the kept entries"),
    ],
)
def test_a_policy_the_model_does_not_take_is_one_line_and_nothing_written(tmp_path, capsys, model, policy, message):
    """Read from the model's skeleton (its sliding layers, its learned sinks) before the run's directory is made."""
    policy, *more = policy.split()
    run = ["run", *RULER, f"model={model}", f"policy={policy}", *more, f"output_dir={tmp_path / 'run'}"]
    assert message in refused(capsys, run, tmp_path / "run")


def test_every_mistake_of_a_sweep_is_in_one_answer(tmp_path, capsys):
    """Two swept keys each with a bad value: both in one line, exit 2, nothing written."""
    sweep = ["run", "-m", *RULER, "policy=snapkv,snapvk", "budget=128,abc", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    error = refused(capsys, sweep, tmp_path / "sweep")
    assert error.startswith("kvbench: error: 2 mistakes: invalid budget 'abc'")
    assert "unknown policy 'snapvk'; valid choices: " in error


def test_missing_file_is_one_line_error(tmp_path, capsys):
    run = ["run", "model=tiny_llama", "task=ppl", f"task.path={tmp_path / 'absent.txt'}", f"output_dir={tmp_path}"]
    assert "absent.txt" in refused(capsys, run)


def test_console_script_reports_errors_without_traceback(tmp_path):
    script = Path(sys.executable).parent / "kvbench"
    result = subprocess.run([str(script), "run", "policy=nope"], capture_output=True, text=True, env=os.environ)
    assert result.returncode == 2
    assert result.stderr.startswith("kvbench: error: unknown policy 'nope'") and "Traceback" not in result.stderr


def test_policies_lists_every_policy(capsys):
    """Each part with its kind and paper, then each of its settings with its default and its domain."""
    kvbench("policies")
    listing = capsys.readouterr().out
    for name in ["full", "sink", "h2o", "tova", "snapkv", "pyramidkv", "caote", "fastcaote", "obcache_joint"]:
        assert f"\n{name}  (" in listing, name
    lines = listing.splitlines()

    def settings_of(name: str, kind: str) -> list[str]:
        start = lines.index(next(line for line in lines if line.startswith(f"{name}  ({kind};")))
        rest = lines[start + 1 :]
        return [line.split() for line in rest[: next(i for i, line in enumerate(rest) if not line.startswith(" "))]]

    snapkv = {words[0]: " ".join(words[1:]) for words in settings_of("snapkv", "base")}
    assert snapkv["window=32"].startswith("a token count ≥ 1, a fraction of the budget in (0, 1) or Npct")
    assert snapkv["pool=avg"] == "one of avg, max, none" and snapkv["kernel=5"] == "a kernel width ≥ 1"
    h2o = {words[0]: " ".join(words[1:]) for words in settings_of("h2o", "base")}
    assert h2o["score_window=null"].startswith("null (every query seen) or a token count ≥ 1")
    assert "causal=true" in h2o and "n_sink=0" in h2o and not any("tau" in key for key in h2o)
    assert [words[0] for words in settings_of("pyramid", "layer budget")] == ["beta=20.0", "schedule=exact"]
    assert ["gamma=200.0", "a", "number", "≥", "0"] in settings_of("cake", "base")
    assert settings_of("obcache_joint", "modifier") == []


def test_metrics_are_the_per_sample_records_aggregated(tmp_path):
    """metrics.json recomputed from predictions.jsonl: per-layer and byte KV figures are maxima over samples,
    timings sums, scores means; then on records whose KV figures differ, so that a min would show."""
    from kvbench.config import compose
    from kvbench.job import resolve
    from kvbench.run import summarize
    from kvbench.tasks.base import Task

    out = tmp_path / "run"
    kvbench("run", *RULER, "policy=snapkv", "budget=64", f"output_dir={out}")
    metrics, records = read_run(out)
    kv = [record["kv"] for record in records]
    for key in ("after_prefill_tokens_per_layer", "peak_tokens_per_layer"):
        assert metrics["kv_cache"][key] == [max(column) for column in zip(*(k[key] for k in kv))]
    assert metrics["kv_cache"]["peak_bytes"] == max(k["peak_bytes"] for k in kv)
    assert metrics["timing"]["total_seconds"] == pytest.approx(sum(r["timing"]["total_seconds"] for r in records))
    assert metrics["scores"]["niah_single_1"] == pytest.approx(100 * sum(r["score"] for r in records) / len(records))

    small = {
        "after_prefill_tokens_per_layer": [30, 30],
        "peak_tokens_per_layer": [31, 31],
        "peak_bytes": 10,
        "full_bytes": 10,
    }
    large = {
        "after_prefill_tokens_per_layer": [64, 50],
        "peak_tokens_per_layer": [65, 51],
        "peak_bytes": 90,
        "full_bytes": 200,
    }
    timing = {"prefill_seconds": 1.0, "decode_seconds": 2.0, "total_seconds": 3.0}
    synthetic = [
        {"id": str(i), "subtask": "s", "score": i, "kv": kv, "timing": timing} for i, kv in enumerate((small, large))
    ]
    job = resolve(compose([*RULER, "policy=snapkv", "budget=64"]))

    class Scored(Task):
        name = "scored"
        samples = score = None  # type: ignore[assignment]

    summary = summarize(job, Scored(job.cfg.task, None), synthetic)
    assert summary["kv_cache"] == {
        "after_prefill_tokens_per_layer": [64, 50],
        "peak_tokens_per_layer": [65, 51],
        "peak_bytes": 90,
        "full_bytes": 200,
    }
    assert summary["timing"]["total_seconds"] == 6.0 and summary["scores"] == {"s": 50.0}


def test_save_kept_writes_the_positions_each_head_keeps(tmp_path):
    """``engine.save_kept=true``: kept/<id>.json holds the prompt ids and, per layer and cache head (per query
    head in the repeated layout), the positions the cache holds after prefill — those an engine keeps."""
    from kvbench.engine import Engine
    from kvbench.models import load_model, model_config
    from kvbench.policies import build_policy

    out = tmp_path / "run"
    kvbench(
        "run",
        *RULER,
        "policy=snapkv",
        "policy.window=8",
        "policy.gqa=repeat",
        "budget=64",
        "engine.save_kept=true",
        f"output_dir={out}",
    )
    _, records = read_run(out)
    files = sorted((out / "kept").glob("*.json"))
    assert [json.loads(path.read_text())["id"] for path in files] == sorted(record["id"] for record in records)
    saved = json.loads(files[0].read_text())
    engine = Engine(
        load_model(model_config("tiny_llama")).model, build_policy("snapkv", {"window": 8, "gqa": "repeat"}), 64
    )
    cache = engine.new_cache(len(saved["prompt_ids"]))
    engine.prefill(cache, saved["prompt_ids"])
    assert saved["kept"] == [positions[0].tolist() for positions in cache.kept_positions()]
    assert len(saved["kept"]) == 3 and len(saved["kept"][0]) == 4 and all(len(head) == 64 for head in saved["kept"][0])


def test_a_run_under_a_pipe_shows_progress_without_noise(tmp_path):
    """No terminal (a pipe, a Slurm log): a progress line per sample at first and at the end; no FutureWarning,
    no absl INFO line (ROUGE scoring), scores printed with 2 decimals; ``-v`` lets the library INFO lines through."""
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    args = ["model=tiny_llama", "task=niah", "task.context_lengths=[512]", "task.depths=[25,75]"]
    args += ["task.prompt_format=raw", f"task.essay_dir={essays}", "policy=snapkv", "budget=64"]
    script = str(Path(sys.executable).parent / "kvbench")

    def run(*extra: str) -> str:
        result = subprocess.run(
            [script, *extra, "run", *args, f"output_dir={tmp_path / '-'.join(extra or ('quiet',))}"],
            capture_output=True,
            text=True,
            env=os.environ,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout + result.stderr

    output = run()
    assert "niah snapkv@64: 1/2 samples, " in output and "niah snapkv@64: 2/2 samples, " in output
    assert "Warning" not in output and "absl" not in output
    (printed,) = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert all(round(value, 2) == value for value in printed["scores"].values())
    assert "[absl][INFO]" in run("-v")


def test_help_lists_every_command_and_version_works(capsys):
    from kvbench import __version__
    from kvbench.cli import COMMANDS

    kvbench("--help")
    listed = {line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("    kvbench ")}
    assert set(COMMANDS) <= listed
    kvbench("--version")
    assert capsys.readouterr().out == f"kvbench {__version__}\n"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_answers_help_with_its_usage(flag, capsys):
    """``kvbench COMMAND --help`` prints how the command is typed and exits 0, for the commands that take Hydra
    overrides (which read ``--help`` as an override) and plain words alike; nothing is run."""
    from kvbench.cli import COMMANDS

    for command in COMMANDS:
        try:
            kvbench(command, flag)
        except SystemExit as exit:  # argparse's and Hydra's own help exit 0
            assert exit.code in (0, None), command
        out = capsys.readouterr().out
        assert f"kvbench {command}" in out or "usage:" in out.lower() or "Powered by Hydra" in out, (command, out)


def readme_commands() -> list[list[str]]:
    """Every ``kvbench ...`` command of the README and the pages of docs/: the command column of their tables and
    their code lines."""
    import re
    import shlex

    from kvbench import PROJECT_ROOT

    pages = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    found = [cell.replace("\\|", "|") for cell in re.findall(r"^\| `(kvbench [^`]*)`", text, re.MULTILINE)]
    fenced = "\n".join(re.findall(r"^```.*?\n(.*?)^```", text, re.MULTILINE | re.DOTALL))
    found += [line.split("#")[0] for line in re.findall(r"^(kvbench (?!\S*:).*)$", fenced, re.MULTILINE)]
    return [shlex.split(command)[1:] for command in found]


def test_the_readme_commands_are_the_clis(capsys):
    """Each README command names a command of the CLI; each ``--flag`` written with a command is in its
    ``--help``; each ``kvbench run`` example resolves through ``kvbench plan`` without an unknown name, key or
    value (a job may still lack its data or model on this machine)."""
    from kvbench.cli import COMMANDS

    commands = readme_commands()
    assert len(commands) > 15
    for args in commands:
        args = [arg for arg in args if arg not in ("-v", "--verbose")]
        if args[0] in ("--version", "--help"):
            continue
        assert args[0] in COMMANDS, args
        flags = [arg.split("=")[0] for arg in args[1:] if arg.startswith("--")]
        if flags and args[0] not in ("run", "plan"):
            with pytest.raises(SystemExit):
                kvbench(args[0], "--help")
            usage = capsys.readouterr().out
            assert all(flag in usage for flag in flags), (args, usage)
        if args[0] == "run" and not any("=" not in arg and not arg.startswith("-") for arg in args[1:]):
            try:
                kvbench("plan", *args[1:])
            except SystemExit:
                pass
            captured = capsys.readouterr()
            assert "kvbench: error:" not in captured.err, (args, captured.err)
            errors = [error for line in captured.out.splitlines() for error in json.loads(line)["errors"]]
            assert not [error for error in errors if error and ("unknown" in error or ": must be" in error)], args


def test_the_readme_fits_a_first_screen_and_links_pages_that_exist():
    """The README stays a first screen (≤ 250 lines); every docs/ page it links exists, every page is linked, and no
    page is over 300 lines."""
    import re

    from kvbench import PROJECT_ROOT

    text = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count("\n") <= 250
    linked = set(re.findall(r"\]\((docs/[^)]+\.md)\)", text))
    assert all((PROJECT_ROOT / page).is_file() for page in linked), linked
    assert {f"docs/{page.name}" for page in (PROJECT_ROOT / "docs").glob("*.md")} <= linked
    lengths = {page.name: page.read_text(encoding="utf-8").count("\n") for page in (PROJECT_ROOT / "docs").glob("*.md")}
    assert {name: count for name, count in lengths.items() if count > 300} == {}


@pytest.mark.model
def test_the_readme_python_example_runs(capsys):
    """The README's Python API example, run as it is on the offline SmolLM2: the cache cut to the budget."""
    import re

    from kvbench import PROJECT_ROOT

    text = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "7341" in printed and "[128, 128" in printed  # it answers its question, from the cut cache


def test_a_sweeps_unknown_key_is_one_line(tmp_path, capsys):
    """An unknown key in a multirun (``-m``), and Hydra's own composition error there: one line, exit 2, no sweep
    folder."""
    for key, said in [
        ("foo=1", "unknown key foo for the run config"),
        ("hydra.foo=1", "Could not override 'hydra.foo'"),
    ]:
        sweep = ["run", "-m", "model=tiny_llama", "policy=snapkv,h2o", key, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
        assert said in refused(capsys, sweep, tmp_path / "sweep")


def test_a_disk_that_refuses_a_line_is_one_line_naming_the_file_and_the_free_space(tmp_path, monkeypatch):
    """A full disk while a sample's line is written: one line naming predictions.jsonl and the free space; the
    partial line it may leave is dropped by the next run's repair."""
    import errno

    from kvbench import rundir
    from kvbench.errors import KVBenchError

    def full(_):
        raise OSError(errno.ENOSPC, "No space left on device")

    run = rundir.RunDir(tmp_path)
    monkeypatch.setattr(rundir.os, "fsync", full)
    with pytest.raises(KVBenchError) as error:
        run.append({"id": "a", "subtask": "t", "score": 1.0})
    assert str(error.value).startswith(f"cannot write {run.predictions_path}: No space left on device; ")
    assert "GiB free on " in str(error.value) and "\n" not in str(error.value)
    monkeypatch.undo()
    run.predictions_path.write_text(run.predictions_path.read_text() + '{"id": "b", "sub')
    run.repair()
    assert [record["id"] for record in run.records()] == ["a"]


def test_a_jobs_policy_spec_is_parsed_once(tmp_path, monkeypatch):
    """``kvbench run`` of one job parses its policy spec once (the parse kept per spec: ``policies.parsed``), however
    often the config, the plan, the job and the engine ask for it."""
    from kvbench import policies

    parses: list[str] = []
    inner = policies.parsed.__wrapped__
    counted = functools.cache(lambda spec: parses.append(spec) or inner(spec))
    monkeypatch.setattr(policies, "parsed", counted)
    kvbench("run", *RULER, "policy=snapkv+obcache_joint", "budget=64", f"output_dir={tmp_path}")
    assert (tmp_path / "metrics.json").exists() and parses.count("snapkv+obcache_joint") == 1


@pytest.mark.parametrize("command, line", [("run", "finished and written by this command"), ("table", "")])
def test_a_stopped_command_says_so_and_only_run_speaks_of_resuming(command, line, capsys):
    """Ctrl-C in ``run`` says how many samples it wrote and that the same command resumes the rest; in a command
    that writes no samples (``table``, ``prepare``), only that it stopped."""
    from kvbench.cli import stopped

    with pytest.raises(SystemExit) as exit_info:
        stopped(KeyboardInterrupt(), command)
    error = capsys.readouterr().err
    assert exit_info.value.code == 130 and error.count("\n") == 1
    if command == "run":
        assert error.startswith("kvbench: stopped by SIGINT: ") and line in error
    else:
        assert error == "kvbench table: stopped by SIGINT\n"
