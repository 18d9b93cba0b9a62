"""``kvbench plan``: every job resolved and validated before anything runs, one JSON line per job."""

from __future__ import annotations

import json

import pytest

from kvbench.cli import main
from tests.helpers import refused

TINY = [
    "model=tiny_llama",
    "task=ruler",
    "task.subtasks=[niah_single_1]",
    "task.context_length=512",
    "task.num_samples=2",
]


def plan(capsys, *args: str) -> tuple[list[dict], str, int]:
    try:
        main(["plan", *args])
        code = 0
    except SystemExit as exit_info:
        code = int(exit_info.code or 0)
    captured = capsys.readouterr()
    return [json.loads(line) for line in captured.out.splitlines()], captured.err, code


@pytest.fixture
def longbench_files(tmp_path, monkeypatch):
    """A LongBench data folder (``KVBENCH_LONGBENCH_DIR``) holding a file per dataset: what plan checks."""
    from kvbench.tasks.longbench import DATASETS

    for dataset in DATASETS:
        (tmp_path / f"{dataset}.jsonl").touch()
    monkeypatch.setenv("KVBENCH_LONGBENCH_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def weights_here(monkeypatch):
    """Every model's weights taken to be on this machine (the paper models are not): what plan checks."""
    monkeypatch.setattr("kvbench.run.factories.check_weights", lambda model: None)


def test_slake_plan_shows_table_3_exponents_on_every_slake_job(capsys, longbench_files, weights_here):
    lines, err, code = plan(capsys, "-m", "+experiment=slake")
    assert code == 0 and len(lines) == 3 * 4 * 2 and "kvbench plan: 24 jobs, 0 invalid" in err
    table3 = {
        ("llama2_7b_chat", "128"): (0.5, 0.4),
        ("llama2_7b_chat", "256"): (0.5, 0.4),
        ("llama31_8b", "128"): (0.4, 0.2),
        ("llama31_8b", "256"): (0.6, 0.5),
        ("mistral7b_v03", "128"): (0.6, 0.5),
        ("mistral7b_v03", "256"): (0.4, 0.2),
    }
    slake = [line for line in lines if line["policy"]["spec"] == "cake+slake"]
    assert len(slake) == 6
    for line in slake:
        budget = line["policy"]["params"]["layer_budget"]
        key = (line["config"]["model"]["name"], line["config"]["budget"]["spec"])
        assert (budget["name"], budget["alpha"], budget["beta"]) == ("vabs", *table3[key])
        assert line["config"]["policy"] == line["policy"]["params"] and not line["errors"]
    pyramid = next(line for line in lines if line["policy"]["spec"] == "pyramidkv")
    assert pyramid["policy"]["params"]["layer_budget"]["schedule"] == "kvcache_factory"


def test_invalid_jobs_are_listed_with_their_line_and_exit_2(capsys):
    lines, err, code = plan(capsys, "-m", *TINY, "policy=h2o,snapkv", "budget=32,64", "policy.window=32")
    assert code == 2 and "kvbench plan: 4 jobs, 2 invalid" in err
    errors = {(line["overrides"][-3], line["overrides"][-2]): (line["errors"] or [None])[0] for line in lines}
    assert errors["policy=snapkv", "budget='64'"] is None and errors["policy=h2o", "budget='64'"] is None
    assert (
        "policy snapkv reserves 32 of its 32-token budget (window/sinks) in a prompt longer than the budget"
        in errors["policy=snapkv", "budget='32'"]
    )
    assert "policy h2o reserves 32 of its 32-token budget" in errors["policy=h2o", "budget='32'"]
    assert all("\n" not in (error or "") for error in errors.values())
    reasons = [line for line in err.splitlines() if "job(s) invalid:" in line]
    assert len(reasons) == 2 and all(line.startswith("kvbench plan: 1 job(s) invalid: policy ") for line in reasons)
    assert all("(e.g. " in line and "budget='32'" in line for line in reasons)


def test_plan_counts_tokens_and_finished_runs(tmp_path, capsys):
    out = tmp_path / "run"
    main(["run", *TINY, "policy=snapkv", "budget=64", f"output_dir={out}"])
    capsys.readouterr()
    (done,), err, code = plan(capsys, *TINY, "policy=snapkv", "budget=64", f"output_dir={out}")
    assert code == 0 and done["finished"] and done["output_dir"] == str(out)
    assert "1 already finished; 0 tokens to prefill" in err
    (todo,), err, _ = plan(capsys, *TINY, "policy=tova", "budget=64", f"output_dir={tmp_path / 'other'}")
    assert not todo["finished"] and todo["tokens"] == {"prefill": 2 * 512 - 2 * 128, "decode": 2 * 128}
    assert "768 tokens to prefill, 256 to decode" in err


@pytest.mark.parametrize("typo", ["+policy.score_windw=16", "+task.contxt_length=9"])
def test_unknown_keys_are_errors_in_plan_as_in_run(typo, capsys):
    with pytest.raises(SystemExit):
        main(["plan", *TINY, typo])
    summary, reason = capsys.readouterr().err.splitlines()  # the counts, then the reason with the job
    key = typo.split("=")[0][1:]
    assert "1 invalid" in summary and reason.startswith(f"kvbench plan: 1 job(s) invalid: unknown key {key}")


def test_a_job_whose_data_is_not_here_is_invalid_with_the_fix(tmp_path, monkeypatch, capsys):
    """LongBench neither cached nor reachable (an empty hub cache, offline), or a data_dir without the dataset's
    file, NeedleBench and PG19 offline without a local copy: each job is invalid, its line says how to provide
    the data; a RULER job (generated) stays valid."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = ["model=tiny_llama", "policy=snapkv", "budget=64"]
    cases = [
        (["task=longbench", "task.datasets=[trec]", "task.data_dir=null"],
         "data.zip of the hub dataset THUDM/LongBench is not cached and the hub is unreachable; unzip data/*.jsonl "
         "of data.zip into a folder and set task.data_dir=FOLDER (or KVBENCH_LONGBENCH_DIR)"),
        (["task=longbench", "task.datasets=[trec]", f"task.data_dir={tmp_path}"],
         f"LongBench dataset 'trec' not found: expected {tmp_path / 'trec.jsonl'}; "),
        (["task=needlebench", "task.subtasks=[single_en]", "task.prompt_format=raw", "task.grid=4k"],
         "needles.jsonl of the hub dataset opencompass/NeedleBench is not cached and the hub is unreachable; "
         "download needles.jsonl (and the other files of the hub dataset opencompass/NeedleBench) into a folder"),
        (["task=pg19"],
         "the hub dataset emozilla/pg19 cannot be streamed: the hub is unreachable; put PG19 test books "),
    ]  # fmt: skip
    for args, error in cases:
        lines, err, code = plan(capsys, *model, *args)
        assert code == 2 and lines[0]["errors"][0].startswith(error), lines[0]["errors"]
    lines, _, code = plan(capsys, *model, "task=ruler", "task.subtasks=[niah_single_1]", "task.num_samples=1")
    assert code == 0 and lines[0]["errors"] == []


def test_missing_weights_and_missing_data_are_named_together(tmp_path, monkeypatch, capsys):
    """The headline command on a machine with neither Llama-3.1-8B nor LongBench: plan names both, and run
    refuses before loading anything with the same two reasons, writing nothing."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    args = ["model=llama31_8b", "policy=h2o+obcache_joint", "budget=4k", "task=longbench", "task.data_dir=null"]
    (line,), err, code = plan(capsys, *args)
    model_error = "model llama31_8b (meta-llama/Llama-3.1-8B-Instruct) is not available offline"
    assert code == 2 and len(line["errors"]) == 2, line["errors"]
    assert line["errors"][0].startswith(model_error)
    assert line["errors"][1].startswith("data.zip of the hub dataset THUDM/LongBench is not cached")
    assert err.count("1 job(s) invalid:") == 2
    out = tmp_path / "run"
    error = refused(capsys, ["run", *args, f"output_dir={out}"], out)
    assert model_error in error and "data.zip" in error


def test_time_estimates_each_job_from_a_measured_sample(capsys):
    """``--time`` loads the model, times one sample per task and gives each job and the total a wall time."""
    lines, err, code = plan(capsys, "--time", "-m", *TINY, "policy=snapkv,h2o", "budget=64")
    assert code == 0 and len(lines) == 2 and all(line["seconds"] > 0 for line in lines)
    assert "kvbench plan: timing a sample of ruler on tiny_llama" in err
    assert "of wall time here as the sweep runs" in err and "one job after another" in err
    lines, err, code = plan(capsys, *TINY, "policy=snapkv", "budget=64")
    assert lines[0]["seconds"] is None and "wall time" not in err


def test_durations_count_hours_past_a_day():
    """A paper-scale plan runs for days: the hours are not wrapped at 24."""
    from kvbench import duration

    assert [duration(0), duration(59.6), duration(15 * 3600 + 42 * 60 + 57), duration(30 * 3600 + 61)] == [
        "0:00:00",
        "0:01:00",
        "15:42:57",
        "30:01:01",
    ]


def test_a_sweep_sets_each_methods_own_settings_on_the_specs_that_have_it(capsys):
    """``policy.chunkkv.chunk_length=8 policy.snapkv.window=16`` over ``policy=snapkv+chunkkv,kvzip,snapkv``: each
    job's policy has what its base and modifiers were given, the others their defaults (their configs show it); a
    method no swept spec has, a sweep of one method's setting and an unknown setting are one line, exit 2."""
    swept = ["-m", *TINY, "policy=snapkv+chunkkv,kvzip,snapkv", "task.query_mode=agnostic"]
    lines, _, code = plan(capsys, *swept, "policy.chunkkv.chunk_length=8", "policy.snapkv.window=16")
    policies = {line["config"]["policy"]["name"]: line["config"]["policy"] for line in lines}
    assert code == 0 and policies["snapkv+chunkkv"]["chunk_length"] == 8 and policies["snapkv+chunkkv"]["window"] == 16
    assert policies["snapkv"]["window"] == 16 and "chunk_length" not in policies["kvzip"]
    assert policies["kvzip"] == plan(capsys, *swept)[0][1]["config"]["policy"]  # untouched
    for mistake, said in [
        ("policy.chunkkv.chunk_length=8", "policy.chunkkv.* sets chunkkv, which none of policy=snapkv,h2o has"),
        ("policy.snapkv.window=8,16", "policy.snapkv.window is one method's setting: give it one value"),
        ("policy.snapkv.windw=8", "unknown key policy.windw for policy snapkv; valid keys: "),
    ]:
        _, err, code = plan(capsys, "-m", *TINY, "policy=snapkv,h2o", mistake)
        assert code == 2 and said in err and err.count("\n") == 1, err
