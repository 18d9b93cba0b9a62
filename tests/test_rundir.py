"""A run directory holds one configuration: resumed only by the same settings, refused by others (exit 2, one
line, not a byte changed), default directories that never collide, nothing written by a job that fails."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvbench.cli import main
from kvbench.identity import identity_differences
from kvbench.rundir import RunDir, run_dirs_below
from tests.helpers import refused

FIXTURES = Path(__file__).parent / "fixtures"
RULER = ["task=ruler", "task.subtasks=[niah_single_1]", "task.num_samples=2"]
BASE = ["model=tiny_llama", *RULER, "task.context_length=640", "policy=snapkv", "policy.window=8", "budget=64"]

#: a change of each kind of setting: (the override that changes it, the key the refusal names)
CHANGES = {
    "task": ("task.context_length=700", "task.context_length=640 there, 700 here"),
    "policy": ("policy.window=16", "policy.window=8 there, 16 here"),
    "budget": ("budget=32", "budget.spec=64 there, 32 here"),
    "engine": ("engine.block_size=32", "engine.block_size=128 there, 32 here"),
    "model": ("model=tiny_mistral", "model.name=tiny_llama there, tiny_mistral here"),
}


#: a finished sample's line (every field :data:`kvbench.rundir.RECORD_FIELDS` asks for)
COMPLETE = {"id": "s", "subtask": "t", "prediction": "p", "score": 0.0}


def changed(override: str) -> list[str]:
    key = override.split("=")[0]
    return [arg for arg in BASE if arg.split("=")[0] != key] + [override]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file below ``path`` (relative name → bytes)."""
    return {str(file.relative_to(path)): file.read_bytes() for file in sorted(path.rglob("*")) if file.is_file()}


@pytest.mark.parametrize("kind", list(CHANGES))
def test_other_settings_are_refused_and_default_directories_differ(kind, tmp_path, monkeypatch, capsys):
    """A run of other settings into a finished directory: exit 2, one line naming the key with both values,
    every file byte-identical; with the default output_dir both runs land apart and both finish."""
    monkeypatch.chdir(tmp_path)
    override, named = CHANGES[kind]
    main(["run", *BASE])
    (first,) = run_dirs_below(tmp_path / "results")
    main(["run", *changed(override)])
    (second,) = set(run_dirs_below(tmp_path / "results")) - {first}
    for path in (first, second):
        assert (path / "metrics.json").exists()
        assert Path(yaml.safe_load((path / "config.yaml").read_text())["output_dir"]).resolve() == path.resolve()
    before = snapshot(first)
    error = refused(capsys, ["run", *changed(override), f"output_dir={first}"])
    assert named in error and f"run directory {first} holds a run of other settings" in error
    assert "resume=restart" in error and "output_dir=" in error
    assert snapshot(first) == before


def test_same_settings_resume_and_a_finished_run_is_not_rerun(tmp_path, capsys):
    out = tmp_path / "run"
    main(["run", *BASE, f"output_dir={out}"])
    before = snapshot(out)
    capsys.readouterr()
    main(["run", *BASE, f"output_dir={out}", "logger=none"])
    assert f"kvbench: {out}: finished with these settings, nothing to run" in capsys.readouterr().err
    assert snapshot(out) == before


def test_restart_moves_the_old_files_aside(tmp_path, capsys):
    out = tmp_path / "run"
    main(["run", *BASE, f"output_dir={out}"])
    before = snapshot(out)
    main(["run", *changed("budget=32"), f"output_dir={out}", "resume=restart"])
    (aside,) = [path for path in out.iterdir() if path.name.startswith("superseded-")]
    assert re.fullmatch(r"superseded-\d{8}T\d{6}Z", aside.name)
    kept = {name: data for name, data in before.items() if name not in ("run.lock", "kvbench.log")}  # they stay
    assert snapshot(aside) == kept
    assert json.loads((out / "metrics.json").read_text())["budget"] == "32"
    assert yaml.safe_load((out / "config.yaml").read_text())["budget"]["spec"] == "32"
    assert run_dirs_below(tmp_path) == [out]  # the superseded files are not a second run in the tables


@pytest.mark.parametrize(
    "args",
    [
        ["task.subtasks=[niah_sngle_1]"],  # unknown subtask
        ["task.subtasks=[niah_sngle_1]", "resume=restart"],  # ... when asked to start again: nothing moved
        ["resume=sometimes"],  # bad value
        ["task.num_samples=0", "resume=restart"],  # no samples
        ["task=ppl", "task.path=/nonexistent/book.txt", "resume=restart"],  # missing data
    ],
)
def test_a_failing_job_leaves_a_finished_directory_untouched(args, tmp_path, capsys):
    out = tmp_path / "run"
    main(["run", *BASE, f"output_dir={out}"])
    before = snapshot(out)
    overrides = [arg for arg in BASE if arg.split("=")[0] not in {a.split("=")[0] for a in args}]
    if "task=ppl" in args:
        overrides = [arg for arg in overrides if not arg.startswith("task.")]
    refused(capsys, ["run", *overrides, *args, f"output_dir={out}"])
    assert snapshot(out) == before
    new = tmp_path / "new"
    refused(capsys, ["run", *overrides, *args, f"output_dir={new}"])
    assert not new.exists()


def test_a_killed_run_resumes_without_losing_or_repeating_a_sample(tmp_path):
    """kill -9 in the middle of a run; the rerun with the same settings keeps every line written, redoes the
    sample cut short (if any) and writes each id once."""
    out = tmp_path / "run"
    args = ["run", "model=tiny_llama", *RULER[:-1], "task.num_samples=40", "task.context_length=640"]
    args += ["task.tokens_to_generate=32", "policy=h2o", "budget=64", f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "import sys; from kvbench.cli import main; main(sys.argv[1:])", *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    predictions = out / "predictions.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if predictions.exists() and predictions.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = [line for line in predictions.read_text().splitlines(keepends=True) if line.endswith("\n")]
    assert 3 <= len(written) < 40 and not (out / "metrics.json").exists()
    subprocess.run(command, env=env, check=True, capture_output=True)
    lines = predictions.read_text().splitlines(keepends=True)
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == 40
    assert lines[: len(written)] == written  # not recomputed
    assert json.loads((out / "metrics.json").read_text())["num_samples"] == 40


def test_differences_name_every_changed_leaf():
    saved = {"task": {"n": 1, "sub": ["a"]}, "logger": {"name": "none"}, "output_dir": "x", "seed": 0}
    current = {"task": {"n": 2, "sub": ["a"]}, "logger": {"name": "wandb"}, "output_dir": "y", "extra": {"k": 1}}
    assert identity_differences(saved, current) == [
        "extra.k=(unset) there, 1 here",
        "seed=0 there, (unset) here",
        "task.n=1 there, 2 here",
    ]


def test_a_directory_with_results_but_no_config_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "predictions.jsonl").write_text('{"id": "x"}\n')
    error = refused(capsys, ["run", *BASE, f"output_dir={out}"])
    assert f"run directory {out} holds results but no config.yaml" in error
    assert snapshot(out) == {"predictions.jsonl": b'{"id": "x"}\n'}
    assert RunDir(out).conflict({}) is not None


def test_plan_reports_a_directory_of_other_settings_as_invalid(tmp_path, capsys):
    out = tmp_path / "run"
    main(["run", *BASE, f"output_dir={out}"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *changed("budget=32"), f"output_dir={out}"])
    assert exit_info.value.code == 2
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    other = f"run directory {out} holds a run of other settings: budget.spec=64 there, 32 here"
    assert line["errors"][0].startswith(other)
    main(["plan", *BASE, f"output_dir={out}"])
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert line["errors"] == [] and line["finished"]


def test_a_setting_added_later_leaves_older_runs_their_identity():
    """``task.query_mode`` came after run directories were made: at ``aware`` (what they ran) it is no part of a run's
    identity, so they keep their names and resume; ``agnostic`` makes another run."""
    from kvbench.identity import run_identity

    before = {"task": {"name": "ruler", "context_length": 1024}, "policy": {"name": "snapkv"}}
    aware = {"task": {"name": "ruler", "context_length": 1024, "query_mode": "aware"}, "policy": {"name": "snapkv"}}
    agnostic = {**aware, "task": {**aware["task"], "query_mode": "agnostic"}}
    assert run_identity(aware) == run_identity(before) != run_identity(agnostic)


def test_a_run_grows_in_its_directory_and_a_smaller_one_reads_its_first_samples(tmp_path, monkeypatch, capsys):
    """``task.num_samples`` is not part of a run's identity: a 2-sample run rerun with 4 lands in the same default
    directory and appends the 2 it lacks after the 2 it has (byte-identical); rerun with 2 it reads their records,
    loads no model and writes nothing, its scores those of the first run."""
    monkeypatch.chdir(tmp_path)
    four = [*changed("task.num_samples=4")]

    def run_line(args: list[str]) -> tuple[dict, str]:
        main(["run", *args])
        captured = capsys.readouterr()
        return json.loads(captured.out.strip().splitlines()[-1]), captured.err

    first, _ = run_line(BASE)
    (directory,) = run_dirs_below(tmp_path / "results")
    before = (directory / "predictions.jsonl").read_bytes()
    run_line(four)
    assert run_dirs_below(tmp_path / "results") == [directory]
    after = (directory / "predictions.jsonl").read_bytes()
    assert after.startswith(before) and after.count(b"\n") == 4
    assert json.loads((directory / "metrics.json").read_text())["num_samples"] == 4
    files = {path: path.read_bytes() for path in directory.rglob("*") if path.is_file() and path.name != "run.lock"}
    monkeypatch.setattr(
        "kvbench.run.lifecycle.load_model", lambda *args: pytest.fail("a model was loaded to read samples")
    )
    again, err = run_line(BASE)
    assert again["scores"] == first["scores"] and "holds these 2 samples of a larger run" in err
    assert {path: path.read_bytes() for path in files} == files


@pytest.mark.parametrize(
    "task",
    [
        ["task=ruler", "task.subtasks=[niah_single_1,niah_multikey_1]", "task.context_length=1024"],
        ["task=ruler", "task.subtasks=[niah_multikey_1]", "task.context_length=1024", "task.questions_per_context=4"],
        ["task=longbench", "task.datasets=[trec,hotpotqa]", f"task.data_dir={FIXTURES / 'longbench'}"],
        ["task=ppl", "task.max_tokens=64"],
    ],
)
def test_a_tasks_samples_are_prefix_stable(task):
    """Asked for 1, then 2 samples per subtask, the one is among the two, the same prompt (LongBench keeps a draw in
    file order): a run can grow without redoing a sample."""
    from kvbench.config import compose
    from kvbench.models import load_tokenizer
    from kvbench.run import build_task

    def samples(count: int) -> dict[str, dict[str, list[int]]]:
        cfg = compose(["model=tiny_llama", *task, f"task.num_samples={count}"])
        by_subtask: dict[str, dict[str, list[int]]] = {}
        for sample in build_task(cfg, load_tokenizer(cfg.model)).samples():
            by_subtask.setdefault(sample.subtask, {})[sample.id] = sample.input_ids
        return by_subtask

    one, two = samples(1), samples(2)
    assert one.keys() == two.keys() and all(len(one[name]) == 1 and len(two[name]) == 2 for name in one)
    assert all(two[name][sample] == prompt for name in one for sample, prompt in one[name].items())


@pytest.mark.parametrize(
    "experiment",
    ["leaderboard", *(pytest.param(name, marks=pytest.mark.slow) for name in ("leaderboard_needle", "leaderboard_ppl"))]
    + ["leaderboard_agnostic", "leaderboard_headwise", "shared_context"],
)
def test_every_job_of_a_committed_experiment_finds_its_finished_run(experiment, capsys, monkeypatch):
    """``make leaderboard`` and ``make shared-context`` find their finished runs: ``kvbench plan`` of each experiment
    names, for every job, a committed run directory finished with its settings (nothing would run again)."""
    from kvbench import PROJECT_ROOT

    if not (PROJECT_ROOT / "results" / ("leaderboard" if "leaderboard" in experiment else experiment)).is_dir():
        pytest.skip("no committed results")
    monkeypatch.chdir(PROJECT_ROOT)  # the experiments' sweep folders are relative
    main(["plan", "-m", f"+experiment={experiment}"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines and all(line["finished"] and not line["errors"] for line in lines)


def test_records_keep_predictions_holding_unicode_line_breaks(tmp_path):
    """A prediction with U+2028, U+2029 or NEL (written as they are: ``ensure_ascii=False``) stays one record: the
    file is split at newlines only, so the sample is neither dropped (and redone) nor counted short."""
    from kvbench.rundir import RunDir

    run = RunDir(tmp_path)
    texts = ["plain", "line\u2028separator", "para\u2029graph", "next\x85line"]
    for number, text in enumerate(texts):
        run.append({**COMPLETE, "id": f"s{number}", "prediction": text})
    assert [record["prediction"] for record in run.records()] == texts


@pytest.mark.parametrize(
    "poison",
    [{"id": "ID"}, {"id": "ID", "subtask": "niah_single_1"}, {**COMPLETE, "id": "ID", "score": "1"}, ["ID"], "ID"],
)
def test_a_line_that_is_not_a_finished_sample_is_redone_and_the_directory_finishes(poison, tmp_path, capsys):
    """A valid-JSON line that is not a finished sample's (an ``id`` alone, a field missing or of another type, not an
    object) is not taken for one: the rerun drops it, redoes that sample and finishes the run."""
    out = tmp_path / "run"
    main(["run", *BASE, f"output_dir={out}"])
    predictions = out / "predictions.jsonl"
    lines = predictions.read_text().splitlines()
    second = json.loads(lines[1])
    poisoned = json.loads(json.dumps(poison).replace('"ID"', json.dumps(second["id"])))
    predictions.write_text(lines[0] + "\n" + json.dumps(poisoned) + "\n")
    (out / "metrics.json").unlink()
    main(["run", *BASE, f"output_dir={out}"])
    records = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [record["id"] for record in records] == [json.loads(lines[0])["id"], second["id"]]
    assert records[1]["prediction"] == second["prediction"]
    assert json.loads((out / "metrics.json").read_text())["num_samples"] == 2


def test_a_task_adds_the_fields_its_aggregate_reads():
    """A record lacking a field its task's aggregate reads (the perplexity task's NLL) is not finished."""
    from kvbench.rundir import complete
    from kvbench.tasks.ppl import PerplexityTask

    record = {**COMPLETE, "prediction": None, "nll": 1.0, "num_tokens": 4}
    assert complete(record, PerplexityTask.required_fields)
    assert not complete({key: value for key, value in record.items() if key != "nll"}, PerplexityTask.required_fields)


def test_rows_attention_is_part_of_a_run_and_each_keeps_older_runs_their_directory(tmp_path, capsys):
    """``engine.rows_attention=padded`` rounds otherwise than ``each``: a run of one into the directory of the other is
    refused in one line, nothing appended; ``each`` (what every older run ran with) leaves the identity as it was."""
    from kvbench.identity import run_identity

    out = tmp_path / "run"
    main(["run", *BASE, "task.num_samples=1", "engine.rows_attention=padded", f"output_dir={out}"])
    before = snapshot(out)
    error = refused(capsys, ["run", *BASE, "task.num_samples=1", "engine.rows_attention=each", f"output_dir={out}"])
    assert "engine.rows_attention=padded there, each here" in error
    assert snapshot(out) == before
    settings = {"engine": {"rows_attention": "each", "regime": "oneshot"}}
    assert run_identity(settings) == {"engine": {"regime": "oneshot"}}
    assert run_identity({"engine": {"rows_attention": "padded"}}) == {"engine": {"rows_attention": "padded"}}


@pytest.mark.parametrize("value", ["../escaped", "/tmp/absolute", "..", "a/../../b", "", "x\x00y"])
def test_a_value_read_from_data_or_a_run_directory_names_a_file_inside_its_folder(value, tmp_path):
    """Subtasks (``kvbench prepare``), sample ids (kept sets), table names and task names read from a run directory
    never make a path outside their folder."""
    from kvbench import file_name
    from kvbench.results.render import write_tables
    from kvbench.tasks.registry import task_class

    name = file_name(value, ".jsonl")
    assert (tmp_path / name).parent == tmp_path and "/" not in name and name not in (".", "..")
    run = RunDir(tmp_path / "run")
    run.write_kept(value, [1, 2], [[[0]]])
    (written,) = write_tables({value: "x"}, tmp_path / "tables", "markdown")
    assert written.parent == tmp_path / "tables" and [p.parent for p in (run.path / "kept").iterdir()] == [
        run.path / "kept"
    ]
    assert task_class(f"../task/{value}ruler") is None and task_class("../../conf/task/ruler") is None
    assert not (tmp_path.parent / "escaped.jsonl").exists()


def test_prepare_writes_each_subtask_inside_the_output_directory(tmp_path, capsys):
    """``kvbench prepare`` of a QA file whose subtask column says ``../escaped``: the file is written inside
    ``output_dir``."""
    rows = [{"context": "c", "question": " q?", "answer": "a", "task": "../escaped"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out" / "inner"
    main(["prepare", "model=tiny_llama", "task=qa", f"task.path={data}", "task.subtask_column=task",
          "task.prompt_format=raw", f"output_dir={out}"])  # fmt: skip
    assert [path.name for path in out.iterdir()] == [".._escaped.jsonl"]
    assert not (tmp_path / "out" / "escaped.jsonl").exists()


@pytest.mark.parametrize("text", ["model: [unclosed\n", "- a list\n", "\udcff".encode("utf-8", "surrogateescape")])
def test_an_unreadable_config_is_one_line_everywhere(text, tmp_path, capsys):
    """A config.yaml that is not a YAML mapping: ``table`` and ``leaderboard`` say why the directory is left out (and
    name it when every directory is), ``run`` into it refuses in one line; nothing is written."""
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    config = run / "config.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    (run / "metrics.json").write_text("{}")
    before = snapshot(tmp_path)
    for command in (["table", str(tmp_path / "runs")], ["leaderboard", str(tmp_path / "runs")]):
        assert f"1 run directories left out ({run}: {config} is not" in refused(capsys, command)
    error = refused(capsys, ["run", *BASE, f"output_dir={run}"])
    assert f"{config} is not" in error and "resume=restart" in error
    assert snapshot(tmp_path) == before


def test_a_budget_hydra_reads_as_a_float_is_named_by_its_digits():
    """``budget=1e9`` (a float to Hydra) is the budget 1000000000, named so in the config and the directory."""
    from kvbench.config import compose

    assert compose(["model=tiny_llama", "budget=1e9"]).budget.spec == "1000000000"
    assert compose(["model=tiny_llama", "budget=2K"]).budget.spec == "2k"


def test_a_resumed_run_keeps_the_settings_that_made_its_records(tmp_path):
    """A run grown from 1 to 2 samples with another ``engine.batch_size`` (outside the identity): config.yaml keeps
    the batch size that made the first record; only ``task.num_samples`` follows the run."""
    out = tmp_path / "run"
    main(["run", *BASE, "task.num_samples=1", "engine.batch_size=1", f"output_dir={out}"])
    main(["run", *BASE, "task.num_samples=2", "engine.batch_size=3", f"output_dir={out}"])
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["engine"]["batch_size"] == 1 and saved["task"]["num_samples"] == 2
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 2


#: why each setting left out of a run's identity changes no prediction: what it is, or the test that shows it
NOT_IDENTITY_EVIDENCE = {
    "hydra": "where a sweep writes its files and how it launches (no engine setting)",
    "logger": "where metrics are logged",
    "output_dir": "where the run's files go",
    "resume": "what happens to earlier files",
    "policy_settings": "test_an_experiments_policy_settings_reach_the_identity_through_the_policy",
    "engine.batch_size": "tests/test_rows.py::test_a_batched_run_and_group_give_what_batch_1_gives",
    "engine.threads": "test_the_thread_count_changes_no_prediction",
    "task.num_samples": "test_a_tasks_samples_are_prefix_stable",
}


def test_every_setting_outside_the_identity_says_why_it_changes_no_prediction():
    """A setting joins :data:`kvbench.rundir.NOT_IDENTITY` only with its reason here (engine.rows_attention, which
    rounds otherwise, left it for the identity)."""
    from kvbench.identity import NOT_IDENTITY

    assert set(NOT_IDENTITY) == set(NOT_IDENTITY_EVIDENCE)


def test_the_thread_count_changes_no_prediction(tmp_path):
    """One CPU thread or two: the same records (timings aside) and kept sets."""
    from tests.test_groups import outcome

    for threads in (1, 2):
        main(
            [
                "run",
                *BASE,
                "engine.save_kept=true",
                f"engine.threads={threads}",
                f"output_dir={tmp_path / str(threads)}",
            ]
        )
    assert outcome(tmp_path / "1") == outcome(tmp_path / "2")


def test_an_experiments_policy_settings_reach_the_identity_through_the_policy():
    """``policy_settings`` (an experiment's per-policy defaults) are applied to ``policy.*``, which is identity: a
    run under other policy settings has another identity, though the ``policy_settings`` node itself is left out."""
    from omegaconf import OmegaConf

    from kvbench.config import compose
    from kvbench.identity import run_identity

    board = compose(["+experiment=leaderboard", "policy=snapkv+slake", "budget=10pct"])
    assert board.policy.layer_budget.alpha == 0.5 and board.policy.layer_budget.beta == 0.4  # its policy_settings
    settings = run_identity(OmegaConf.to_container(board, resolve=True))
    assert "policy_settings" not in settings and settings["policy"]["layer_budget"]["alpha"] == 0.5


def test_a_saved_config_reads_as_omegaconf_reads_it_and_again_once_rewritten(tmp_path):
    """``RunDir.saved_config`` (YAML read as OmegaConf reads it, no ``DictConfig`` built; read once while the file is
    unchanged) gives what ``OmegaConf.load`` gives, for a job's settings with floats written as ``1e-05``, nulls,
    lists, strings that look like numbers or booleans; a rewritten file is read again."""
    from omegaconf import OmegaConf

    from kvbench import config_dict
    from kvbench.config import compose

    settings = config_dict(compose(["model=tiny_llama", "policy=snapkv+criticalkv", "budget=64"]), resolve=True)
    settings["extra"] = {"small": 1e-5, "none": None, "list": [1, "2", 3.5], "yes": "yes", "digits": "007"}
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_config(settings)
    assert run_dir.saved_config() == config_dict(OmegaConf.load(run_dir.config_path)) == settings
    assert run_dir.saved_config() is run_dir.saved_config()  # read once
    settings["extra"]["small"] = 2.5e-7
    run_dir.write_config(settings)
    assert run_dir.saved_config()["extra"]["small"] == 2.5e-7
    stamp = os.stat(run_dir.config_path).st_mtime_ns
    settings["extra"]["small"] = 7.5e-7  # as long, its stamp kept: written here, read again all the same
    run_dir.write_config(settings)
    os.utime(run_dir.config_path, ns=(stamp, stamp))
    assert run_dir.saved_config()["extra"]["small"] == 7.5e-7


def test_the_config_loader_and_writer_read_and_write_every_committed_config_as_omegaconf_does():
    """:func:`~kvbench.rundir.config_loader` (libyaml's parser, OmegaConf's resolvers) gives what OmegaConf's own
    YAML loader gives for every config committed (the packed runs' and conf/'s) and for the cases the resolvers
    decide: ``1e-5`` a float, a date a string, a path; a key twice is refused by both. :func:`~kvbench.rundir.
    config_text` (libyaml's emitter, OmegaConf's representers) writes each as ``OmegaConf.to_yaml`` does, byte for
    byte, strings that would read as numbers or bools quoted."""
    import omegaconf._utils
    import yaml
    from omegaconf import OmegaConf

    from kvbench import CONF_DIR, PROJECT_ROOT
    from kvbench.config import compose
    from kvbench.packed import PACKED, unpacked
    from kvbench.rundir import config_loader, config_text
    from kvbench.rundir import omegaconf_loader as get_yaml_loader

    assert get_yaml_loader is not config_loader and omegaconf._utils.get_yaml_loader is config_loader  # Hydra's reads
    assert compose(["model=tiny_llama", "policy=snapkv"]).policy.name == "snapkv"
    assert not yaml.__with_libyaml__ or issubclass(config_loader(), yaml.CSafeLoader)
    texts = [path.read_text() for path in CONF_DIR.rglob("*.yaml")]
    for pack in (PROJECT_ROOT / "results").rglob(PACKED):  # the run directories as RunDir reads them
        texts += [path.read_text() for path in unpacked(pack).rglob("config.yaml")]
    texts.append("x: 1e-5\ny: 2026-11-30\nz: .5\nw: 1_000\np: !!python/object/apply:pathlib.Path ['a', 'b']\n")
    assert len(texts) > 500
    for text in texts:
        theirs = yaml.load(text, Loader=get_yaml_loader())
        assert yaml.load(text, Loader=config_loader()) == theirs and theirs is not None
        assert config_text(theirs) == OmegaConf.to_yaml(OmegaConf.create(theirs))
    quoted = {"a": "1e-5", "b": "true", "c": "12", "d": None, "e": [1, "x", 0.5], "f": "héllo ☃", "g": {"h": []}}
    assert (
        config_text(quoted) == OmegaConf.to_yaml(quoted) and yaml.load(config_text(quoted), config_loader()) == quoted
    )
    for loader in (get_yaml_loader(), config_loader()):
        with pytest.raises(yaml.constructor.ConstructorError, match="while constructing a mapping"):
            yaml.load("a: 1\nb: {c: 2, c: 3}\n", Loader=loader)
