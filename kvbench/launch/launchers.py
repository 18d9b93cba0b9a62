"""How kvbench's submitit launchers (``hydra/launcher=slurm|local``, classes in ``hydra_plugins/kvbench``)
submit a sweep and wait for it.

They are hydra-submitit-launcher's, with four changes:

* the Slurm array is named after what it runs (:func:`array_name`; Slurm gives one name to a whole array);
* a submission that ``sbatch`` refuses is one line naming the launcher keys to change (:func:`refusal`);
* every job's outcome is collected, not just the first failure: a job that ended without a result
  (cancelled, killed, out of time or memory) comes back as a failed ``JobReturn`` holding a
  :class:`JobFailure` with the last line of its error and the path of its log;
* Slurm jobs are followed with ``squeue`` (:func:`wait_in_queue`): submitit asks ``sacct``, which a cluster
  without an accounting database does not answer, and would wait for a cancelled job forever.
"""

from __future__ import annotations

import contextlib
import getpass
import io
import logging
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import DictConfig, OmegaConf

from kvbench.errors import KVBenchError
from kvbench.run.progress import LOG_FORMAT, SweepProgress

CLUSTER_KEYS = ("partition", "account", "qos", "gpus_per_node", "cpus_per_task", "mem_gb", "timeout_min", "constraint")
"""The launcher keys (``hydra.launcher.<key>``) that must fit the cluster: ``sbatch`` refuses what it cannot place."""

RESULT_GRACE_S = 15.0
"""How long a job that has left the queue may take to show its result file (a shared filesystem lags)."""


class JobFailure(Exception):
    """A job that ended without a result: the last line of its error, and its log."""

    def __init__(self, message: str, log: Path):
        super().__init__(message)
        self.log = log


def typed(overrides: Sequence[str]) -> list[str]:
    """A job's overrides as the user typed them: without the ``++`` that :func:`kvbench.config.prepare_overrides`
    puts before a group's key (so that composing never fails on a key and the composed config's one check names
    it)."""
    return [override.removeprefix("++") for override in overrides]


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` (of an error message or a log), stripped; empty if none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


PLURALS = {"policy": "policies"}


def array_name(labels: Iterable[dict[str, str]]) -> str:
    """The Slurm job name of an array: each of model, policy, budget and task, as its one value, its values
    joined by ``,`` in the sweep's order (up to three) or their count (``7policies``), e.g.
    ``kvbench-llama3_8b-snapkv,h2o-4budgets-ruler``."""
    labels = list(labels)
    parts = ["kvbench"]
    for key in ("model", "policy", "budget", "task"):
        values = list(dict.fromkeys(label[key] for label in labels))  # in the sweep's order
        parts.append(",".join(values) if len(values) <= 3 else f"{len(values)}{PLURALS.get(key, key + 's')}")
    return "-".join(parts)


def refusal(params: dict[str, Any], error: Exception) -> str:
    """One line for a submission that ``sbatch`` refused: its reason and the launcher keys to change."""
    keys = " ".join(
        f"hydra.launcher.{key}={'null' if params.get(key) is None else params.get(key)}" for key in CLUSTER_KEYS
    )
    return (
        f"sbatch refused the jobs ({last_line(str(error))}); set the launcher keys to what this cluster has "
        f"(`sinfo` lists partitions; defaults in conf/hydra/launcher/slurm.yaml), now: {keys}"
    )


def make_executor(launcher: Any) -> Any:
    """The submitit executor of ``launcher`` (its ``params``, as hydra-submitit-launcher maps them)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    cluster = launcher._EXECUTOR
    params = dict(launcher.params)
    if launcher.array_name:
        params["name"] = launcher.array_name
    init = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        init[f"{cluster}_max_num_timeout"] = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=cluster, **init)
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in shared else f"{cluster}_{key}": value for key, value in params.items()})
    return executor


def submit(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
    """Submit the jobs as one array; a refusal by ``sbatch`` (or no ``sbatch``) is a :class:`KVBenchError`."""
    calls = []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        print(f"kvbench: #{idx} {' '.join(typed(filter_overrides(overrides)))}")
        calls.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
    return map_array(launcher, launcher, calls)


def map_array(launcher: Any, function: Any, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``function`` submitted once per call (its arguments) as one array of ``launcher``'s executor."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    executor = make_executor(launcher)
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's error before raising it
            return executor.map_array(function, *zip(*calls))
    except FileNotFoundError as error:
        raise KVBenchError(
            f"{error.filename or 'sbatch'} is not on PATH: submit from a machine of the Slurm "
            f"cluster, or run the sweep here with hydra/launcher=local"
        ) from None
    except (FailedJobError, FailedSubmissionError) as error:
        raise KVBenchError(refusal(launcher.params, error)) from None


def queued_jobs() -> set[str] | None:
    """The ids (``123_4`` for array tasks) of this user's jobs in Slurm's queue; None if ``squeue`` failed."""
    command = ["squeue", "--noheader", "--array", "--user", getpass.getuser(), "--format", "%i"]
    try:
        output = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return set(output.split())


def wait_in_queue(jobs: list[Any]) -> None:
    """Wait until every Slurm job has its result file, or has left the queue and shown none for
    :data:`RESULT_GRACE_S`; ``squeue`` is asked at growing intervals (1 s to 30 s)."""
    started = time.monotonic()
    left_queue: dict[str, float] = {}
    waiting = list(jobs)
    while True:
        queued = queued_jobs()
        now = time.monotonic()
        still = []
        for job in waiting:
            if job.paths.result_pickle.exists():
                continue
            if queued is not None and job.job_id not in queued:
                left_queue.setdefault(job.job_id, now)
            if queued is None or now - left_queue.get(job.job_id, now) < RESULT_GRACE_S:
                still.append(job)
        waiting = still
        if not waiting:
            return
        time.sleep(min(30.0, 1.0 + (now - started) / 10))


def outcome(job: Any, overrides: Sequence[str]) -> JobReturn:
    """The ``JobReturn`` of a finished job; for one without a result (or whose submitit wrapper failed), a
    failed one holding a :class:`JobFailure` (the last line of its error, its stderr log)."""
    if job.paths.result_pickle.exists():
        try:
            return job.results()[0]
        except Exception as error:  # the job raised outside Hydra's run_job: its traceback comes back
            message = last_line(str(error))
    else:
        message = last_line(job.stderr() or "") or f"job {job.job_id} ended without a result"
    failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
    failed.return_value = JobFailure(message, job.paths.stderr)
    return failed


def wait(launcher: Any, jobs: list[Any]) -> None:
    """Wait for every submitted job (Slurm's through ``squeue``: :func:`wait_in_queue`)."""
    if launcher._EXECUTOR == "slurm":
        wait_in_queue(jobs)
    else:
        for job in jobs:
            job.wait()


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Submit the jobs, wait for all of them, and return every job's outcome (see the module's docstring)."""
    jobs = submit(launcher, job_overrides, initial_job_idx)
    wait(launcher, jobs)
    return [outcome(job, overrides) for job, overrides in zip(jobs, job_overrides)]


#: one job of a group: its overrides, composed config (without ``hydra``) and run directory
Member = tuple[Sequence[str], DictConfig, Path]


def run_group_task(members: list[tuple[DictConfig, Path]], share_prefill: bool) -> list[Any]:
    """One array task: a group of jobs run by :func:`kvbench.run.run_group` in the process submitit started,
    its log lines on that process's stderr and in each job's ``kvbench.log``."""
    from kvbench.run.group import run_group  # the engine, imported where a group runs

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return run_group(members, share_prefill)


def group_returns(members: Sequence[Member], outcomes: Sequence[Any]) -> list[JobReturn]:
    """Each job's ``JobReturn`` from what :func:`kvbench.run.run_group` gave back: its metrics' average, or
    the error it failed with."""
    returns = []
    for (overrides, _, _), result in zip(members, outcomes):
        failed = isinstance(result, Exception)
        returned = JobReturn(overrides=list(overrides), status=JobStatus.FAILED if failed else JobStatus.COMPLETED)
        returned.return_value = result if failed else result["average"]
        returns.append(returned)
    return returns


def launch_groups(
    launcher: Any,
    groups: Sequence[Sequence[Member]],
    initial_job_idx: int,
    share_prefill: bool = False,
    sweep: SweepProgress | None = None,
) -> list[JobReturn]:
    """Run each group of jobs as one task: in this process for Hydra's basic launcher (its samples counted in
    ``sweep``), else one array task per group of the submitit launcher (a task that ended without a result fails
    each of its jobs with :class:`JobFailure`). Returns every job's outcome, in the groups' order."""
    idx = initial_job_idx
    for number, group in enumerate(groups):
        for overrides, _, _ in group:
            print(f"kvbench: #{idx} {' '.join(typed(filter_overrides(overrides)))} (group {number})")
            idx += 1
    payload = [[(cfg, output_dir) for _, cfg, output_dir in group] for group in groups]
    if not hasattr(launcher, "array_name"):  # Hydra's basic launcher: here, one group after another
        from kvbench.run.group import run_group  # the engine, imported where a group runs

        return [
            returned
            for group, members in zip(groups, payload)
            for returned in group_returns(group, run_group(members, share_prefill, sweep))
        ]
    jobs = map_array(launcher, run_group_task, [(members, share_prefill) for members in payload])
    wait(launcher, jobs)
    returns = []
    for job, group in zip(jobs, groups):
        try:
            results = job.results()[0] if job.paths.result_pickle.exists() else None
        except Exception:  # the task raised outside run_group
            results = None
        if results is not None:
            returns += group_returns(group, results)
        else:  # each job fails with the task's error, or the last line of its log (outcome)
            failed = outcome(job, [])
            returns += [replace(failed, overrides=list(overrides)) for overrides, _, _ in group]
    return returns


__all__ = ["CLUSTER_KEYS", "JobFailure", "array_name", "last_line", "launch", "launch_groups", "refusal"]
