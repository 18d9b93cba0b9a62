"""Sweeps: experiment configs, Hydra multirun through the submitit launchers, skipping finished runs, make targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT
from kvbench.cli import main
from kvbench.config import compose as compose_run
from kvbench.config import group_options
from kvbench.policies import build_policy
from kvbench.results.sweeps import experiment_overrides, sweeper_params

KVBENCH = str(Path(sys.executable).parent / "kvbench")
TINY = ["model=tiny_llama", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=512", "task.num_samples=1"]
EXPERIMENTS = group_options("experiment")


def test_every_paper_has_a_paper_and_a_smoke_experiment():
    for paper in ("caote", "obcache", "calidrop", "slake"):
        assert paper in EXPERIMENTS and f"{paper}_smoke" in EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_sweeps_compose_and_build(experiment):
    """Every job of every experiment composes (first value of the other swept keys) and its policy builds."""
    params = sweeper_params(experiment)
    assert {"model", "policy", "budget", "task"} <= set(params)
    first = {key: values.split(",")[0] for key, values in params.items() if key != "policy"}
    for policy in params["policy"].split(","):
        cfg = compose_run([f"+experiment={experiment}", f"policy={policy}", *(f"{k}={v}" for k, v in first.items())])
        assert cfg.policy.name == policy and cfg.task.name == params["task"]
        build_policy(policy, OmegaConf.to_container(cfg.policy, resolve=True))
    if experiment.endswith("_smoke"):
        assert params["model"] == "smollm2_135m"


def test_paper_protocols_are_pinned():
    caote = compose_run(["+experiment=caote"])
    assert (caote.engine.regime, caote.engine.block_size, caote.engine.decode_evict) == ("chunked", 128, True)
    assert sweeper_params("caote")["budget"] == "2k,4k,6k,8k"
    obcache = compose_run(["+experiment=obcache_niah", "policy=snapkv"])
    assert (obcache.engine.regime, obcache.policy.window, obcache.policy.pool, obcache.policy.kernel) == ("oneshot", 16, "max", 7)
    h2o = compose_run(["+experiment=obcache", "policy=h2o"]).policy
    assert (h2o.window, h2o.score_window, h2o.gqa) == (0.05, 0.05, "repeat")  # 5% of the budget (obcache.yaml)
    pg19 = {spec: compose_run(["+experiment=obcache_pg19", f"policy={spec}"]).policy for spec in ("sink", "h2o", "tova")}
    assert [pg19[spec].n_sink for spec in pg19] == [4, 4, 4] and pg19["h2o"].window == 256
    caote_node = compose_run(["+experiment=caote", "policy=snapkv+caote"]).policy
    assert (caote_node.power, caote_node.window, caote_node.pool) == (1.0, 32, "avg")
    calidrop = compose_run(["+experiment=calidrop", "policy=sink+calidrop"])
    assert (calidrop.policy.n_sink, calidrop.policy.theta1, calidrop.policy.theta2) == (32, 0.7, 0.85)
    assert compose_run(["+experiment=calidrop", "policy=snapkv"]).policy.window == 32
    assert sweeper_params("slake")["policy"] == "h2o,pyramidkv,cake,cake+slake"


def test_experiment_sweep_becomes_overrides_and_typed_values_win():
    args = experiment_overrides(["-m", "+experiment=caote_smoke", "policy=h2o"])
    assert args[-3:] == ["-m", "+experiment=caote_smoke", "policy=h2o"]
    injected = dict(arg.split("=", 1) for arg in args[:-3])
    assert injected == {"model": "smollm2_135m", "budget": "64,128", "task": "longbench"}
    assert experiment_overrides(["+experiment=caote_smoke"]) == ["+experiment=caote_smoke"]  # not a multirun
    with pytest.raises(SystemExit):
        main(["run", "-m", "+experiment=nope"])


def test_launcher_configs_compose():
    slurm = compose_run(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True)
    local = compose_run(["hydra/launcher=local"], return_hydra_config=True)
    launcher = slurm.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min, launcher.array_parallelism) == ("gpu", 1, 720, 16)
    assert local.hydra.launcher._target_.endswith("LocalLauncher")


def run_kvbench(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([KVBENCH, "run", *args], capture_output=True, text=True, cwd=PROJECT_ROOT, env=os.environ,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_local_launcher_multirun_completes_then_skips(tmp_path):
    """Two jobs (one a composite policy, registered in the ConfigStore that submitit pickles to the workers)
    through submitit's local executor; submitted again, both are skipped without recomputing."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=local", *TINY, "policy=snapkv,h2o+caote", "budget=64", f"hydra.sweep.dir={sweep}"]
    run_kvbench(*args)
    jobs = sorted(path.name for path in sweep.iterdir() if (path / "metrics.json").exists())
    assert jobs == [f"budget='64',model=tiny_llama,policy={policy},task.context_length=512,task.num_samples=1,"
                    f"task.subtasks=[niah_single_1],task=ruler" for policy in ("h2o+caote", "snapkv")]
    metrics = {job: json.loads((sweep / job / "metrics.json").read_text()) for job in jobs}
    assert {m["policy"] for m in metrics.values()} == {"snapkv", "h2o+caote"}
    assert all(m["num_samples"] == 1 and m["kv_cache"]["after_prefill_tokens_per_layer"] == [64] * 3 for m in metrics.values())
    stamps = {job: (sweep / job / "predictions.jsonl").stat().st_mtime_ns for job in jobs}
    started = time.time()
    run_kvbench(*args)
    assert {job: (sweep / job / "predictions.jsonl").stat().st_mtime_ns for job in jobs} == stamps
    logs = "".join(path.read_text() for path in sweep.glob(".submitit/*/*_log.*"))
    assert logs.count("skipping") == 2
    assert time.time() - started < 600


def test_basic_multirun_skips_finished_and_resumes_changed(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    main(["run", "-m", *TINY, "policy=tova", "budget=32,64", f"hydra.sweep.dir={sweep}"])
    job = sweep / "budget='32',model=tiny_llama,policy=tova,task.context_length=512,task.num_samples=1,task.subtasks=[niah_single_1],task=ruler"
    first = (job / "predictions.jsonl").read_text()
    stamp = (job / "metrics.json").stat().st_mtime_ns
    main(["run", "-m", *TINY, "policy=tova", "budget=32,64", f"hydra.sweep.dir={sweep}"])
    assert (job / "metrics.json").stat().st_mtime_ns == stamp
    # the same job directory with another config is not skipped: it resumes (finished samples kept)
    main(["run", *TINY[:-1], "task.num_samples=2", "policy=tova", "budget=32", f'hydra.run.dir="{job}"'])
    records = (job / "predictions.jsonl").read_text().splitlines()
    assert len(records) == 2 and records[0] + "\n" == first
    assert json.loads((job / "metrics.json").read_text())["num_samples"] == 2


@pytest.mark.slow
def test_make_reproduce_caote_smoke():
    """The whole CAOTE reproduction path at SCALE=smoke on SmolLM2 (several minutes on a CPU)."""
    result = subprocess.run(["make", "-o", ".venv/.installed", "reproduce-caote", "SCALE=smoke"], capture_output=True,
                            text=True, cwd=PROJECT_ROOT, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = PROJECT_ROOT / "results" / "smoke" / "caote" / "report"
    for name in ("compare_caote_table2.md", "compare_caote_table4.md", "compare_caote_table5.md", "longbench.md",
                 "niah.md", "ppl.md", "budget_curves.png", "ppl_vs_length.png"):
        assert (report / name).exists(), name
    assert list(report.glob("heatmap_*.png"))
    table2 = (report / "compare_caote_table2.md").read_text()
    assert "49.20" in table2 and "not run" in table2
    table4 = (report / "compare_caote_table4.md").read_text()
    assert "smollm2_135m" in table4  # our own rows: SmolLM2's PPL gaps
    assert "## caote:table13" in result.stdout
