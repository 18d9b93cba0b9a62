"""``kvbench plan``: every job a ``kvbench run`` would launch, resolved and validated, without loading weights.

Takes the same overrides as ``kvbench run`` (``-m`` for sweeps, experiments included). For each job it composes
the config, resolves it (:func:`kvbench.job.resolve`: per-model settings, unknown keys, a budget the reserved
window would fill), builds its task for the model's tokenizer (the local one where the checkpoint is on this
machine, else a stand-in that checks everything a tokenizer does not decide) and prints one JSON object per
line on stdout::

    {"overrides": [...], "output_dir": ..., "config": {...}, "policy": {"spec": ..., "params": {...}},
     "errors": [one line per reason], "finished": bool, "tokens": {"prefill": n, "decode": n} | null,
     "seconds": estimated wall time (with --time) | null, "group": n | null, "prefill_group": n | null}

In a grouped sweep (``hydra.sweeper.group``, the default) ``group`` numbers the process the job runs in: the jobs
that differ only in policy and budget share one (:func:`kvbench.identity.load_group_key`), the model loaded once.
Where the group also shares its prefills (``hydra.sweeper.share_prefill``), ``prefill_group`` numbers the oneshot jobs
whose samples are prefilled together, by one forward each (:func:`kvbench.engine.shared.generate_shared`); the summary
counts their prefill tokens once.

A job is invalid for a bad value, a run directory holding other settings, or data that is neither here nor
downloadable now. ``--time`` estimates each job's wall time on this machine (:class:`Estimator`: it loads each
model and runs one sample of each task). A summary goes to stderr; the exit status is 2 when any job is invalid.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvbench import config_dict, duration
from kvbench.engine.shared import repeats_kv
from kvbench.engine.threads import set_threads
from kvbench.errors import KVBenchError
from kvbench.identity import node_settings_key
from kvbench.job import Job, resolve
from kvbench.launch.launchers import typed
from kvbench.launch.sweeps import MULTIRUN_FLAGS, compose_job, shared_config_files, sweep_loader, sweep_overrides
from kvbench.packed import packed_run
from kvbench.run import checked_task, local_tokenizer, tokenizer_or_stand_in
from kvbench.rundir import RunDir, finished_metrics
from kvbench.tasks.ppl import PerplexityTask

TIME_FLAG = "--time"


class Estimator:
    """``kvbench plan --time``: each job's wall time from measured throughput on this machine. Each model is
    loaded once (its load time counts for every job: each job loads it), the first sample of each task (model and
    task settings) is run through the engine under the first such job's policy, and a job's samples are taken
    to cost the same per sample: ``load + samples × sample``, with ``samples = planned prompt tokens / the
    measured sample's prompt tokens``. Jobs whose size only their data tells get no estimate.

    :meth:`grouped_seconds` is the wall time of the sweep as it runs: one model load per group, and the jobs of
    one prefill group timed together on their first sample, decoded as rows as ``kvbench run`` does."""

    def __init__(self) -> None:
        self.models: dict[str, tuple[Any, float]] = {}
        self.samples: dict[tuple[str, str], tuple[float, Any]] = {}
        self.jobs: list[tuple[Job, int, int | None, int | None]] = []  # job, prompt tokens, group, prefill group

    def loaded(self, job: Job) -> tuple[Any, float]:
        from kvbench.models import load_model

        model_key = node_settings_key(job.model.settings())
        if model_key not in self.models:
            set_threads(job.engine.threads)
            started = time.perf_counter()
            loaded = load_model(job.model)
            self.models[model_key] = (loaded, time.perf_counter() - started)
        return self.models[model_key]

    def first_sample(self, job: Job) -> tuple[float, Any]:
        """The measured seconds of the task's first sample under ``job``'s policy, and the sample."""
        from kvbench.run import build_engine, build_task, run_sample

        loaded, _ = self.loaded(job)
        task_key = (node_settings_key(job.model.settings()), node_settings_key(job.settings["task"]))
        if task_key not in self.samples:
            task = build_task(job.cfg, loaded.tokenizer)
            sample = next(iter(task.samples()))
            print(f"kvbench plan: timing a sample of {job.cfg.task.name} on {job.model.name}", file=sys.stderr)
            started = time.perf_counter()
            run_sample(build_engine(job, loaded), task, sample, loaded)
            self.samples[task_key] = (time.perf_counter() - started, sample)
        return self.samples[task_key]

    def seconds(
        self, job: Job, prompt_tokens: int, group: int | None = None, prefill_group: int | None = None
    ) -> float:
        """The job's wall time run alone (and the job kept for :meth:`grouped_seconds`)."""
        self.jobs.append((job, prompt_tokens, group, prefill_group))
        _, load_seconds = self.loaded(job)
        sample_seconds, sample = self.first_sample(job)
        return load_seconds + prompt_tokens / len(sample.input_ids) * sample_seconds

    def grouped_seconds(self) -> float:
        """The sweep's wall time as it runs grouped: per group one model load, then its prefill groups' samples
        (timed together) and its other jobs' samples (each as alone)."""
        total = 0.0
        groups: dict[Any, list[tuple[Job, int, int | None]]] = {}
        for index, (job, tokens, group, prefill_group) in enumerate(self.jobs):
            groups.setdefault(("alone", index) if group is None else group, []).append((job, tokens, prefill_group))
        for members in groups.values():
            total += self.loaded(members[0][0])[1]
            together: dict[int, list[tuple[Job, int]]] = {}
            for job, tokens, prefill_group in members:
                if prefill_group is None:
                    sample_seconds, sample = self.first_sample(job)
                    total += tokens / len(sample.input_ids) * sample_seconds
                else:
                    together.setdefault(prefill_group, []).append((job, tokens))
            for jobs in together.values():
                total += self.together_seconds([job for job, _ in jobs]) * max(tokens for _, tokens in jobs)
        return total

    def together_seconds(self, jobs: list[Job]) -> float:
        """The seconds per prompt token of the jobs' first sample prefilled once and decoded as rows together."""
        from kvbench.engine.rows import finished_rows
        from kvbench.run import build_engine, context_rows, samples_batch

        loaded, _ = self.loaded(jobs[0])
        _, sample = self.first_sample(jobs[0])
        engines = [build_engine(job, loaded) for job in jobs]
        batch = samples_batch(jobs[0].cfg, engines, [sample])
        started = time.perf_counter()
        for _ in finished_rows(context_rows(engines, [sample], loaded, batch), batch):
            pass
        return (time.perf_counter() - started) / len(sample.input_ids)


def empty_line(overrides: list[str], output_dir: Path | None, errors: list[str] | None = None) -> dict[str, Any]:
    """A plan line with only what is known before the job is resolved."""
    directory = None if output_dir is None else str(output_dir)
    return {
        "overrides": typed(overrides),
        "output_dir": directory,
        "config": None,
        "policy": None,
        "errors": errors or [],
        "finished": False,
        "tokens": None,
        "seconds": None,
        "group": None,
        "prefill_group": None,
    }


def plan_job(
    overrides: list[str],
    cfg: DictConfig,
    output_dir: Path,
    tokenizers: dict[str, Any],
    estimator: Estimator | None = None,
    group: int | None = None,
    prefill_groups: dict[tuple[int, bool], int] | None = None,
) -> dict[str, Any]:
    """The plan line of one composed job (with ``estimator``, its estimated wall time), in ``group``; with
    ``prefill_groups`` (a sweep sharing its prefills), numbered among the jobs that prefill each sample together."""
    line = empty_line(overrides, output_dir)
    line["group"] = group
    try:
        job = resolve(cfg)
        job.cfg.output_dir = str(output_dir)  # as kvbench run writes it to config.yaml
        line["config"] = config_dict(job.cfg)
        line["policy"] = {"spec": job.policy.spec, "params": line["config"]["policy"]}  # policy.settings()
        tokenizer = tokenizer_or_stand_in(job.model, local_tokenizer(job.model, tokenizers))
        task, line["errors"] = checked_task(job.cfg, tokenizer)
        if task is None:
            return line
        oneshot = job.engine.regime == "oneshot" and not isinstance(task, PerplexityTask)
        if group is not None and prefill_groups is not None and oneshot:
            line["prefill_group"] = prefill_groups.setdefault((group, repeats_kv(job.policy)), len(prefill_groups))
        tokens = task.planned_tokens()
        line["tokens"] = None if tokens is None else {"prefill": tokens[0], "decode": tokens[1]}
        if job.cfg.resume != "restart":
            run_dir = RunDir(packed_run(output_dir))  # a sweep resumes its folder's packed runs
            run_dir.check_same_run(line["config"])
            line["finished"] = finished_metrics(run_dir, job.settings) is not None
        if estimator is not None and tokens is not None and not line["finished"]:
            line["seconds"] = round(estimator.seconds(job, tokens[0], group, line["prefill_group"]), 1)
    except KVBenchError as error:
        line["errors"].append(str(error))
    return line


def plan_lines(args: list[str], estimator: Estimator | None = None) -> Iterator[dict[str, Any]]:
    """The plan line of every job of ``kvbench run ARGS``."""
    from kvbench.config import compose

    tokenizers: dict[str, Any] = {}
    if not any(arg in MULTIRUN_FLAGS for arg in args):
        cfg = compose(args)
        overrides = [arg for arg in args if not arg.startswith("-")]
        yield plan_job(overrides, cfg, Path(str(cfg.output_dir)), tokenizers, estimator)
        return
    with (
        sweep_loader([arg for arg in args if arg not in MULTIRUN_FLAGS]) as (config_loader, master),
        shared_config_files(config_loader),
    ):
        jobs = sweep_overrides(config_loader, master)
        print(f"kvbench plan: resolving {len(jobs)} jobs", file=sys.stderr, flush=True)
        groups: dict[str, int] = {}
        sweeper = master.hydra.sweeper
        prefill_groups: dict[tuple[int, bool], int] | None = {} if sweeper.get("share_prefill") else None
        for overrides in jobs:
            try:
                job = compose_job(config_loader, master, overrides)
            except KVBenchError as error:
                yield empty_line(overrides, None, [str(error)])
                continue
            group = groups.setdefault(job.load_group, len(groups)) if sweeper.get("group") else None
            yield plan_job(overrides, job.cfg, job.output_dir, tokenizers, estimator, group, prefill_groups)


def plan_main(args: list[str]) -> None:
    """Print the plan, one JSON line per job, and a summary on stderr; exit 2 if any job is invalid. ``--time``:
    each job's estimated wall time on this machine (:class:`Estimator`; it loads each model)."""
    estimator = Estimator() if TIME_FLAG in args else None
    jobs = invalid = finished = unknown = 0
    prefill = decode = prefilled = 0  # prefilled: the prefill tokens left once shared prefills count once
    groups: list[int] = []  # the group of each job left to run
    prefill_groups: set[int] = set()
    seconds = 0.0
    reasons: dict[str, list[Any]] = {}  # each distinct reason a job is invalid: [count, the first such job]
    for line in plan_lines([arg for arg in args if arg != TIME_FLAG], estimator):
        seconds += line["seconds"] or 0.0
        print(json.dumps(line, ensure_ascii=False, default=str), flush=True)
        jobs += 1
        valid = not line["errors"]
        invalid += not valid
        for reason in line["errors"]:
            reasons.setdefault(reason, [0, line["overrides"]])[0] += 1
        finished += line["finished"]
        if line["group"] is not None and not line["finished"] and valid:
            groups.append(line["group"])
        if line["tokens"] is None:
            unknown += valid and not line["finished"]
        elif not line["finished"]:
            prefill, decode = prefill + line["tokens"]["prefill"], decode + line["tokens"]["decode"]
            if line["prefill_group"] not in prefill_groups:
                prefilled += line["tokens"]["prefill"]
            if line["prefill_group"] is not None:
                prefill_groups.add(line["prefill_group"])
    tokens = f"{prefill} tokens to prefill, {decode} to decode in the jobs left" + (
        f" (and {unknown} jobs whose size only their data tells)" if unknown else ""
    )
    if estimator is not None and seconds > 0:
        tokens += f"; about {duration(estimator.grouped_seconds())} of wall time here as the sweep runs"
        tokens += f" ({duration(seconds)} one job after another)"
    if groups:
        loads = len(set(groups))
        tokens += f"; the {len(groups)} valid jobs left run in {loads} group(s): {loads} model loads, not {len(groups)}"
    if prefill_groups:
        tokens += f"; prefills shared: {prefilled} tokens prefilled, not {prefill}"
    print(f"kvbench plan: {jobs} jobs, {invalid} invalid, {finished} already finished; {tokens}", file=sys.stderr)
    for reason, (count, overrides) in sorted(reasons.items(), key=lambda item: -item[1][0]):
        example = " ".join(str(override) for override in overrides)
        print(f"kvbench plan: {count} job(s) invalid: {reason}  (e.g. {example})", file=sys.stderr)
    if invalid:
        sys.exit(2)
