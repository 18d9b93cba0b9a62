"""Sweeps on a real Slurm cluster (``hydra/launcher=slurm``): `make test-slurm` starts a single-node one
(scripts/local_slurm.sh), runs these and stops it. Skipped when no cluster answers (no ``sbatch`` on PATH, or
``sinfo`` fails). Each job loads the tiny random model on partition ``cpu`` without GPUs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.launch.sweeps import sweep_jobs
from tests.test_sweeps import TINY, submitit_job_folders

KVBENCH = str(Path(sys.executable).parent / "kvbench")
CPU = [
    "hydra/launcher=slurm",
    "hydra.launcher.partition=cpu",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=4",
]


def cluster_answers() -> bool:
    if shutil.which("sbatch") is None:
        return False
    try:
        return subprocess.run(["sinfo", "--noheader"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not cluster_answers(), reason="no Slurm cluster answers (make test-slurm starts one)"),
]


def sweep(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``kvbench run -m ARGS`` in ``cwd``, as a user types it."""
    return subprocess.run(
        [KVBENCH, "run", "-m", *args], capture_output=True, text=True, cwd=cwd, env=os.environ, timeout=900
    )


def run_dir_name(*overrides: str) -> Path:
    """The run directory of a TINY job with ``overrides`` in an ad-hoc sweep (relative to where it runs)."""
    keys = {override.split("=")[0] for override in overrides}
    (job,) = sweep_jobs([*(arg for arg in TINY if arg.split("=")[0] not in keys), *overrides])
    return job.output_dir


def test_sweep_finishes_then_resubmitting_submits_nothing(tmp_path):
    """Three jobs differing only in policy: one group, so one array task (the model loaded once), the array named
    after what it runs; submitted again: no job, exit 0, in seconds."""
    result = sweep(*TINY, "budget=64", "policy=snapkv,h2o,tova", *CPU, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kvbench: results/multirun: 3 jobs, 0 skipped (0 finished, 0 running), 3 submitted" in result.stdout
    sweep_dir = tmp_path / "results" / "multirun"
    for policy in ("snapkv", "h2o", "tova"):
        metrics = json.loads((tmp_path / run_dir_name("budget=64", f"policy={policy}") / "metrics.json").read_text())
        assert (metrics["policy"], metrics["num_samples"]) == (policy, 1)
    folders = submitit_job_folders(sweep_dir)
    assert len(folders) == 1 and "3 jobs in 1 group" in result.stdout
    script = next(sweep_dir.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --job-name=kvbench-tiny_llama-snapkv,h2o,tova-64-ruler" in script
    started = time.monotonic()
    again = sweep(*TINY, "budget=64", "policy=snapkv,h2o,tova", *CPU, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "3 jobs, 3 skipped (3 finished, 0 running), 0 submitted" in again.stdout
    assert submitit_job_folders(sweep_dir) == folders


def test_every_failed_job_is_reported_and_the_fixed_one_alone_resubmitted(tmp_path):
    tiny = [arg for arg in TINY if not arg.startswith("task.context_length")]
    result = sweep(*tiny, "policy=snapkv", "budget=64", "task.context_length=512,-1", *CPU, cwd=tmp_path)
    assert result.returncode == 1
    run_dir = run_dir_name("budget=64", "policy=snapkv", "task.context_length=-1")
    failures = [line for line in result.stderr.splitlines() if line.startswith("kvbench: failed:")]
    assert failures == [
        f"kvbench: failed: {' '.join(tiny)} policy=snapkv budget='64' task.context_length=-1 | "
        f"run dir: {run_dir} | task.context_length=-1: must be a token count ≥ 1 | "
        f"log: {run_dir / 'kvbench.log'}"
    ]
    assert "task.context_length=-1: must be" in (tmp_path / run_dir / "kvbench.log").read_text()
    good = tmp_path / run_dir_name("budget=64", "policy=snapkv")
    assert (good / "metrics.json").exists()
    fixed = sweep(*tiny, "policy=snapkv", "budget=64", "task.context_length=512,600", *CPU, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "2 jobs, 1 skipped (1 finished, 0 running), 1 submitted" in fixed.stdout


def test_sbatch_refusal_is_one_line_naming_the_launcher_keys(tmp_path):
    """The defaults ask for a GPU, which the cpu partition has not."""
    result = sweep(
        *TINY, "policy=snapkv", "budget=64", "hydra/launcher=slurm", "hydra.launcher.partition=cpu", cwd=tmp_path
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("kvbench: error: sbatch refused the jobs (sbatch: error: Invalid generic resource")
    assert (
        "hydra.launcher.partition=cpu hydra.launcher.account=null hydra.launcher.qos=null "
        "hydra.launcher.gpus_per_node=1 hydra.launcher.cpus_per_task=8 hydra.launcher.mem_gb=64" in result.stderr
    )


def wait_for_predictions(path: Path, count: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, f"{path} did not reach {count} lines"
        time.sleep(0.5)


def test_running_job_is_not_submitted_twice_and_a_cancelled_one_resumes(tmp_path):
    """While a job runs, its sweep submitted again skips it (its run directory is locked); cancelled mid-run, it
    is reported failed with Slurm's line; submitted again, it resumes: one prediction per id, none redone. The job is
    suspended (``scontrol suspend``) once it has written two samples, so that it is mid-run however fast it goes."""
    tiny = [arg for arg in TINY if not arg.startswith(("task.context_length", "task.num_samples"))]
    args = [*tiny, "task.context_length=2048", "task.num_samples=200", "policy=snapkv", "budget=64", *CPU]
    run_dir = tmp_path / run_dir_name("budget=64", "policy=snapkv", "task.context_length=2048", "task.num_samples=200")
    with subprocess.Popen(
        [KVBENCH, "run", "-m", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=os.environ,
    ) as first:
        try:
            wait_for_predictions(run_dir / "predictions.jsonl", 2)
            for folder in submitit_job_folders(tmp_path / "results/multirun"):
                subprocess.run(["scontrol", "suspend", folder.split("_")[0]], check=True)
            second = sweep(*args, cwd=tmp_path)
            assert second.returncode == 0 and "1 jobs, 1 skipped (0 finished, 1 running), 0 submitted" in second.stdout
        finally:
            for folder in submitit_job_folders(tmp_path / "results/multirun"):
                subprocess.run(["scancel", folder.split("_")[0]], check=True)
        _, err = first.communicate(timeout=300)
    assert first.returncode == 1
    (failure,) = [line for line in err.splitlines() if line.startswith("kvbench: failed:")]
    assert f"| run dir: {run_dir.relative_to(tmp_path)} | " in failure
    assert failure.endswith(f"| log: {tmp_path / 'results/multirun/.submitit' / folder / (folder + '_0_log.err')}")
    done = [json.loads(line)["id"] for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert 2 <= len(done) < 200
    resumed = sweep(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 jobs, 0 skipped (0 finished, 0 running), 1 submitted" in resumed.stdout
    assert (
        f"writing {run_dir} (resuming, {len(done)} samples done, {200 - len(done)} to go: "
        in (run_dir / "kvbench.log").read_text()
    )
    ids = [json.loads(line)["id"] for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 200 and ids[: len(done)] == done
    assert json.loads((run_dir / "metrics.json").read_text())["num_samples"] == 200
