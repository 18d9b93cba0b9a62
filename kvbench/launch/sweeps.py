"""Sweeps: ``kvbench run -m`` over the values given, or the sweep a ``conf/experiment`` file pins.

An experiment file (``# @package _global_``) pins a paper's protocol and lists its sweep in
``hydra.sweeper.params``. Hydra would hand those values to the sweeper unchecked — composite policies
such as ``h2o+caote`` would not be found and ``budget: 64`` would be read as an int — so before Hydra
starts they are turned into ordinary command-line sweep overrides (:func:`experiment_overrides`), which
``kvbench.config.prepare_overrides`` then validates and registers like typed ones. What the user typed
for the same key wins.

A sweep runs through kvbench's sweeper (``conf/hydra/sweeper/kvbench.yaml``, class in ``hydra_plugins/kvbench``, on
Hydra's public ``Sweeper`` plugin API, with the basic sweeper's keys): before any job is submitted it composes every
job (:func:`expand_sweep`), drops those whose run directory is finished with the same config or is being written now,
and after the launcher returns it reports every failed job in one line (:func:`run_sweep`).
A job's run directory is named after its settings (``hydra.sweep.subdir``: ``${run_name:}``), so a later sweep finds it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import multiprocessing
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from kvbench import CONF_DIR, config_dict
from kvbench.config import experiment_config, prepare_overrides
from kvbench.engine.threads import usable_cpus
from kvbench.errors import KVBenchError, fail
from kvbench.identity import load_group_key
from kvbench.job import check_known_keys, resolve
from kvbench.launch.launchers import JobFailure, array_name, last_line, launch_groups, typed
from kvbench.packed import PACKED, unpack
from kvbench.run.progress import SweepProgress
from kvbench.rundir import STOP_SIGNALS, RunDir, finished_metrics

MULTIRUN_FLAGS = ("-m", "--multirun")


def sweeper_params(experiment: str) -> dict[str, str]:
    """``hydra.sweeper.params`` of ``conf/experiment/<experiment>.yaml`` (with the files it includes)."""
    cfg = experiment_config(experiment)
    return {str(key): str(value) for key, value in (cfg.hydra.sweeper.params or {}).items()}


def experiment_overrides(args: list[str]) -> list[str]:
    """``args`` with the sweep of the ``+experiment=NAME`` they select put in front, as overrides.

    Only for a multirun (``-m``); a single run of an experiment ignores its sweep, as Hydra does."""
    if not any(arg in MULTIRUN_FLAGS for arg in args):
        return args
    try:
        overrides = OverridesParser.create().parse_overrides([arg for arg in args if not arg.startswith("-")])
    except HydraException:
        return args  # prepare_overrides reports the parse error
    experiments = [o.get_value_element_as_str() for o in overrides if o.key_or_group == "experiment"]
    if not experiments:
        return args
    typed = {override.key_or_group for override in overrides}
    params = sweeper_params(experiments[-1])
    return [f"{key}={values}" for key, values in params.items() if key not in typed] + args


@dataclass
class SweepJob:
    """One job of a sweep: its overrides, its composed config (without ``hydra``, as the job receives it),
    its run directory and the log Hydra writes there."""

    overrides: list[str]
    cfg: DictConfig
    output_dir: Path
    log: Path

    @property
    def label(self) -> dict[str, str]:
        """What the job runs: its model, policy, budget and task."""
        return {
            "model": str(self.cfg.model.name),
            "policy": str(self.cfg.policy.name),
            "budget": str(self.cfg.budget.spec),
            "task": str(self.cfg.task.name),
        }

    @property
    def load_group(self) -> str:
        """Its :func:`~kvbench.identity.load_group_key`: the jobs sharing one model load and one task's samples."""
        return load_group_key(config_dict(self.cfg, resolve=True))


def compose_job(config_loader: Any, master: DictConfig, overrides: list[str]) -> SweepJob:
    """The :class:`SweepJob` of one job's overrides, composed as its launcher will compose it."""
    try:
        config = config_loader.load_sweep_config(master, overrides)
        output_dir = Path(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))
        log = output_dir / f"{config.hydra.job.name}.log"
    except (HydraException, OmegaConfBaseException) as error:
        raise KVBenchError(f"job {' '.join(typed(overrides))}: {last_line(str(error).splitlines()[0])}") from None
    cfg = copy.deepcopy(config)  # its own nodes: a shared config repository's compositions share some
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    check_known_keys(config_dict(cfg, resolve=True))
    return SweepJob(overrides, cfg, output_dir, log)


def sweep_overrides(config_loader: Any, master: DictConfig) -> list[list[str]]:
    """The overrides of every job of the sweep whose config is ``master`` (composed in multirun mode): the
    cartesian product of ``hydra.sweeper.params`` and the command line's overrides (what is typed wins, whatever
    its ``+``/``++`` prefix: a dotted key is typed ``++task.query_mode``, which Hydra's sweeper would take for another
    key and sweep twice), as Hydra's basic sweeper makes it."""
    typed = {str(override).split("=", 1)[0].lstrip("+~") for override in master.hydra.overrides.task}
    params = [f"{key}={value}" for key, value in (master.hydra.sweeper.params or {}).items() if key not in typed]
    try:
        overrides = OverridesParser.create(config_loader=config_loader).parse_overrides(
            [*params, *master.hydra.overrides.task]
        )
        choices: dict[str, list[str]] = {}  # each key's settings, in the order the keys come (a later one wins)
        for override in overrides:
            key = override.get_key_element()
            if override.is_sweep_override() and not override.is_discrete_sweep():
                raise HydraException(f"kvbench's sweeper sweeps a choice or a list of values, not {override}")
            if override.is_sweep_override():
                choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
            else:
                choices[key] = [f"{key}={override.get_value_element_as_str()}"]
    except HydraException as error:
        raise KVBenchError(f"cannot expand the sweep: {str(error).splitlines()[0]}") from None
    return [list(combination) for combination in itertools.product(*choices.values())]


@contextmanager
def shared_config_files(config_loader: Any) -> Iterator[None]:
    """Inside the block the jobs that ``config_loader`` composes share one config repository: each config file is read
    once for the sweep, not once per job. Hydra gives every composition a fresh caching repository (a deep copy of
    every config source, every YAML file parsed again: 30 s of the leaderboard's 267 jobs, 13 s shared); its cache
    is the one Hydra already shares between the parts of one composition. A job that sets ``hydra.searchpath`` (its
    own config sources) gets a fresh one. Same configs: tests/test_sweeps.py."""
    from hydra._internal.config_repository import CachingConfigRepository

    shared = CachingConfigRepository(config_loader.repository)

    def parse_overrides_and_repository(config_name: str | None, overrides: list[str]) -> tuple[list[Any], Any]:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
        own_sources = any(override.get_key_element() == "hydra.searchpath" for override in parsed)
        repository = CachingConfigRepository(config_loader.repository) if own_sources else shared
        config_loader._process_config_searchpath(config_name, parsed, repository)
        return parsed, repository

    config_loader._parse_overrides_and_create_caching_repo = parse_overrides_and_repository
    try:
        yield
    finally:
        del config_loader._parse_overrides_and_create_caching_repo


#: a sweep composes its jobs in forked processes, one per usable CPU, with at least this many jobs each (composing is
#: Hydra's merging in Python, ≈ 50 ms a job: the leaderboard's 267 jobs 14.2 s in one process, 7.9 s in two)
JOBS_PER_COMPOSER = 64

#: what a forked composer composes from (:func:`expand_sweep`), set while its pool runs
_composing: tuple[Any, DictConfig] | None = None


def _composer_signals() -> None:
    """A forked composer's stop signals, set before it unblocks them: SIGTERM's default action, by which its pool ends
    it (``kvbench``'s handler, inherited, raises in Python, which a SIGTERM can pass by: the pool's end then waits on
    the composer for ever), and SIGINT ignored (Ctrl-C reaches the whole process group; the sweep's own process stops
    and ends the pool)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _compose_forked(overrides: list[str]) -> SweepJob:
    assert _composing is not None  # inherited from expand_sweep through fork
    return compose_job(*_composing, overrides)


def expand_sweep(config_loader: Any, master: DictConfig) -> list[SweepJob]:
    """Every job of the sweep whose config is ``master``, composed (:func:`compose_job`), in order: by forked processes
    where the sweep is large and the platform forks (:data:`JOBS_PER_COMPOSER`), else here."""
    global _composing
    every = sweep_overrides(config_loader, master)
    composers = min(usable_cpus(), len(every) // JOBS_PER_COMPOSER)
    with shared_config_files(config_loader):
        if composers < 2 or "fork" not in multiprocessing.get_all_start_methods():
            return [compose_job(config_loader, master, overrides) for overrides in every]
        _composing = config_loader, master
        # forked with the stop signals blocked, so that none reaches a composer before its own handling is set (a
        # signal taken by a Python handler that is then reset to the default is dropped)
        stops = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            try:
                pool = multiprocessing.get_context("fork").Pool(composers, _composer_signals)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, stops)
            with pool:
                return pool.map(_compose_forked, every, chunksize=max(1, JOBS_PER_COMPOSER // 4))
        finally:
            _composing = None


@contextmanager
def sweep_loader(args: list[str]) -> Iterator[tuple[Any, DictConfig]]:
    """Hydra's config loader and the multirun master config of ``kvbench run -m ARGS`` (``-m`` may be left
    out), experiments' sweeps included, for composing its jobs inside the block."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    overrides = [
        arg for arg in prepare_overrides(experiment_overrides([MULTIRUN_FLAGS[0], *args])) if not arg.startswith("-")
    ]
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        config_loader = GlobalHydra.instance().config_loader()
        try:
            master = config_loader.load_configuration("config", overrides, run_mode=RunMode.MULTIRUN)
        except HydraException as error:
            raise KVBenchError(f"cannot compose the sweep: {str(error).splitlines()[0]}") from None
        yield config_loader, master


def sweep_jobs(args: list[str]) -> list[SweepJob]:
    """The jobs of ``kvbench run -m ARGS`` (``-m`` may be left out): overrides, composed config, run directory
    and log of each, in submission order, before anything is submitted or written. With
    :func:`split_pending` it tells what a submission would run."""
    with sweep_loader(args) as (config_loader, master):
        return expand_sweep(config_loader, master)


def split_pending(jobs: list[SweepJob]) -> tuple[list[SweepJob], list[SweepJob], list[SweepJob]]:
    """``jobs`` as (finished with the same config, being written by a process now, to submit). A job whose
    run directory holds a run of other settings is refused before anything is submitted (one line, naming the
    first such directory), unless it runs with ``resume=restart``."""
    finished, running, todo, conflicts = [], [], [], []
    for job in jobs:
        run_dir = RunDir(job.output_dir)
        try:
            resolved = resolve(job.cfg).settings
        except KVBenchError:  # submitted, and reported as it fails
            resolved = None
        done = None
        if resolved is not None and resolved["resume"] != "restart":
            conflict = run_dir.conflict(resolved)
            if conflict is not None:
                conflicts.append(conflict)
                continue
            done = finished_metrics(run_dir, resolved)
        if done is not None:
            finished.append(job)
        elif run_dir.locked():
            running.append(job)
        else:
            todo.append(job)
    if conflicts:
        others = f" (and {len(conflicts) - 1} other jobs' directories)" if len(conflicts) > 1 else ""
        raise KVBenchError(
            f"{conflicts[0]}{others}; nothing submitted: give the sweep another hydra.sweep.dir, or pass "
            f"resume=restart to move their files into superseded-<time>/ sub-folders"
        )
    return finished, running, todo


def group_jobs(jobs: list[SweepJob]) -> list[list[SweepJob]]:
    """The jobs by :func:`kvbench.identity.load_group_key` (those differing only in policy and budget), in order of
    first appearance."""
    groups: dict[str, list[SweepJob]] = {}
    for job in jobs:
        groups.setdefault(job.load_group, []).append(job)
    return list(groups.values())


def failure_line(job: SweepJob, returned: JobReturn) -> str:
    """One line for a failed job: its overrides, run directory, the last line of its error and its log (the
    job's log in its run directory, or for a job that ended without a result, its launcher's log)."""
    error = returned._return_value  # JobReturn.return_value would raise it
    message = last_line(str(error))
    if not isinstance(error, (KVBenchError, JobFailure)):
        message = f"{type(error).__name__}: {message}"
    log = error.log if isinstance(error, JobFailure) else job.log
    return f"kvbench: failed: {' '.join(typed(job.overrides))} | run dir: {job.output_dir} | {message} | log: {log}"


def launch_pending(sweeper: Any) -> list[list[JobReturn]]:
    """Submit the sweep's jobs that are not finished nor running, in batches of ``max_batch_size``; say how
    many were skipped and submitted, then report every failure and exit 1 if any failed."""
    context, config, launcher = sweeper.hydra_context, sweeper.config, sweeper.launcher
    assert context is not None and config is not None and launcher is not None  # set by Hydra's setup()
    jobs = expand_sweep(context.config_loader, config)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    if unpacked := unpack(sweep_dir):  # a folder's packed runs (kvbench pack) resume as run directories
        print(f"kvbench: {sweep_dir / PACKED}: {len(unpacked)} files unpacked to resume its runs", flush=True)
    finished, running, todo = split_pending(jobs)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")  # the latest sweep, as Hydra writes it; and each one's:
    OmegaConf.save(config, sweep_dir / datetime.now(timezone.utc).strftime("multirun-%Y%m%dT%H%M%S.%fZ.yaml"))
    print(
        f"kvbench: {sweep_dir}: {len(jobs)} jobs, {len(finished) + len(running)} skipped ({len(finished)} finished, "
        f"{len(running)} running), {len(todo)} submitted",
        flush=True,
    )
    grouped = getattr(sweeper, "group", False)
    units = group_jobs(todo) if grouped else [[job] for job in todo]  # what one process (one array task) runs
    if grouped and todo:
        groups = f"{len(units)} group{'s' if len(units) > 1 else ''}"
        print(f"kvbench: {len(todo)} jobs in {groups}, the model loaded once per group", flush=True)
    todo = [job for unit in units for job in unit]  # in the groups' order
    returns: list[list[JobReturn]] = []
    size = max(1, len(units) if sweeper.max_batch_size in (None, -1) else sweeper.max_batch_size)  # Hydra's -1: all
    in_process = grouped and not hasattr(launcher, "array_name")  # the groups run here: their progress is known here
    with SweepProgress(len(todo)) if in_process else contextlib.nullcontext() as progress:
        for batch in (units[start : start + size] for start in range(0, len(units), size)):
            if hasattr(launcher, "array_name"):
                launcher.array_name = array_name(job.label for unit in batch for job in unit)
            done = sum(map(len, returns))
            if grouped:
                members = [[(job.overrides, job.cfg, job.output_dir.absolute()) for job in unit] for unit in batch]
                share = bool(getattr(sweeper, "share_prefill", False))
                returns.append(launch_groups(launcher, members, done, share, progress))
            else:
                returns.append(list(launcher.launch([job.overrides for (job,) in batch], done)))
    outcomes = [returned for batch in returns for returned in batch]
    failures = [failure_line(job, r) for job, r in zip(todo, outcomes) if r.status != JobStatus.COMPLETED]
    for line in failures:
        print(line, file=sys.stderr)
    if failures:
        print(
            f"kvbench: {len(failures)} of {len(todo)} submitted jobs failed; fix them and submit the sweep "
            f"again: only the unfinished jobs are submitted",
            file=sys.stderr,
        )
        sys.exit(1)
    if todo:
        print(f"kvbench: {len(todo)} jobs done")
    return returns


def run_sweep(sweeper: Any) -> list[list[JobReturn]] | None:
    """The kvbench sweeper's ``sweep``: :func:`launch_pending`, a bad value (or a submission refused) as one
    line ``kvbench: error: ...`` with exit status 2."""
    try:
        return launch_pending(sweeper)
    except KVBenchError as error:
        fail(str(error))


__all__ = [
    "SweepJob",
    "expand_sweep",
    "experiment_overrides",
    "run_sweep",
    "shared_config_files",
    "split_pending",
    "sweep_jobs",
    "sweeper_params",
]
