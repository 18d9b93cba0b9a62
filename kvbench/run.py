"""``kvbench run``: one model × policy × budget × task, written to a resumable run directory."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, cast

from hydra.utils import get_class
from omegaconf import DictConfig
from tqdm import tqdm

from kvbench import config_dict, duration
from kvbench.engine import Engine
from kvbench.engine.rows import Row, batch_rows, decode_rows, finished_rows, perplexity_rows
from kvbench.engine.runner import GenerationOutput, PerplexityOutput
from kvbench.engine.shared import Question, prefill_questions, prefill_shared
from kvbench.engine.threads import set_threads
from kvbench.errors import KVBenchError, SharedPassWarning
from kvbench.job import Job, resolve
from kvbench.models import LoadedModel, check_weights, load_model, load_tokenizer
from kvbench.results.wandb_logger import log_run
from kvbench.rundir import RunDir, finished_metrics, identity
from kvbench.tasks.base import ModelInfo, Sample, Task

log = logging.getLogger(__name__)

#: the format of a job's log lines (Hydra's job logging's)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"

#: the settings the jobs of one group may differ in (:func:`group_key`)
GROUPED = ("policy", "budget")


class Progress:
    """Per-sample progress: tqdm's bar in a terminal; without one (a pipe, a Slurm log) a log line after the
    first sample, then every ``every`` seconds and at the end, with the rate and the time left. ``sweep``: a job of
    a sweep that says its progress as a whole (:class:`SweepProgress`), which counts its samples; the job's own line
    comes at its end only."""

    def __init__(self, total: int, label: str, every: float = 30.0, sweep: SweepProgress | None = None):
        self.total, self.label, self.every, self.sweep = total, label, every, sweep
        self.done = 0
        self.started = self.last = time.monotonic()
        self.bar = tqdm(total=total, desc=label) if sys.stderr.isatty() and sweep is None else None
        if sweep is not None:
            sweep.opened(total)

    def advance(self) -> None:
        self.done += 1
        if self.sweep is not None:
            self.sweep.written()
        if self.bar is not None:
            self.bar.update()
            return
        now = time.monotonic()
        alone = self.sweep is None
        if self.done == self.total or (alone and (self.done == 1 or now - self.last >= self.every)):
            self.last = now
            per_sample = (now - self.started) / self.done
            left = per_sample * (self.total - self.done)
            log.info(
                "%s: %d/%d samples, %.2f s/sample, about %s left",
                self.label,
                self.done,
                self.total,
                per_sample,
                duration(left),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class SweepProgress:
    """The progress of a sweep whose jobs run in this process, as a whole: a line ``first`` seconds after it starts,
    then every ``every`` seconds, from a thread (rows decode several samples together: a sample can take minutes
    to finish) — the samples written of those to run, their rate and the time left. A job's samples count once it
    starts; the jobs not started yet are taken to have as many as the started ones on average."""

    def __init__(self, jobs: int, first: float = 20.0, every: float = 60.0):
        self.jobs, self.first, self.every = jobs, first, every
        self.started_jobs = self.total = self.done = 0
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self.report, name="kvbench-sweep-progress", daemon=True)

    def opened(self, samples: int) -> None:
        with self.lock:
            self.started_jobs += 1
            self.total += samples

    def written(self) -> None:
        with self.lock:
            self.done += 1

    def line(self) -> str:
        with self.lock:
            started_jobs, total, done = self.started_jobs, self.total, self.done
        seconds = time.monotonic() - self.started
        expected = round(total / started_jobs * self.jobs) if started_jobs else None
        text = f"kvbench: sweep: {done}/{expected if expected is not None else '?'} samples written"
        text += f", {started_jobs}/{self.jobs} jobs started, {duration(seconds)} in"
        if done and expected is not None:
            text += f", {done / seconds:.2f} samples/s, about {duration(seconds / done * (expected - done))} left"
        else:
            text += "; the first samples' rows are running"
        return text

    def report(self) -> None:
        wait = self.first
        while not self.finished.wait(wait):
            print(self.line(), file=sys.stderr, flush=True)
            wait = self.every

    def __enter__(self) -> SweepProgress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished.set()


def build_task(cfg: DictConfig, tokenizer) -> Task:
    """Instantiate the task class named by ``task._target_`` for this model's tokenizer, window and id."""
    try:
        task_class = get_class(cfg.task._target_)
    except Exception as error:
        raise KVBenchError(f"task {cfg.task.name!r}: cannot import {cfg.task._target_}: {error}") from None
    info = ModelInfo(cfg.model.name, tokenizer, int(cfg.model.context_window), cfg.model.hf_id)
    return task_class(cfg.task, info)


def checked_task(cfg: DictConfig, tokenizer) -> tuple[Task | None, list[str]]:
    """The job's task, and every reason this machine cannot run the job, found at once and before anything
    loads: weights neither here nor downloadable now, data the same, a task that cannot be built."""
    reasons = []
    try:
        check_weights(cfg.model)
    except KVBenchError as error:
        reasons.append(str(error))
    try:
        task = build_task(cfg, tokenizer)
        task.check_data()
    except KVBenchError as error:
        return None, [*reasons, str(error)]
    return (task if not reasons else None), reasons


def settings_key(node: DictConfig) -> str:
    """A config node's settings as one string: a key for what was loaded or measured for them."""
    return json.dumps(config_dict(node, resolve=True), sort_keys=True)


def local_tokenizer(model: DictConfig, cache: dict[str, Any] | None = None) -> Any | None:
    """The model's own tokenizer where this machine has it (loaded once per model with ``cache``), else None;
    nothing is downloaded."""
    cache = {} if cache is None else cache
    key = settings_key(model)
    if key not in cache:
        try:
            with hub_offline():
                cache[key] = load_tokenizer(model)
        except (KVBenchError, OSError, ValueError):
            cache[key] = None
    return cache[key]


def tokenizer_or_stand_in(model: DictConfig, tokenizer: Any | None) -> Any:
    """``tokenizer``, or where it is None a stand-in that checks everything a tokenizer does not decide."""
    from kvbench.engine.tokenizers import stand_in_tokenizer

    return stand_in_tokenizer(int(model.context_window)) if tokenizer is None else tokenizer


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Local files only: a checkpoint not on this machine is not downloaded to check or plan a job."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def build_engine(job: Job, loaded: LoadedModel) -> Engine:
    """The engine running the job's policy and budget on the loaded model."""
    engine = job.cfg.engine
    return Engine(
        loaded.model,
        job.policy,
        job.budget,
        regime=engine.regime,
        block_size=engine.block_size,
        decode_evict=engine.decode_evict,
        attn_backend=loaded.attn_backend,
        score_block=engine.score_block,
        record_kept=engine.save_kept,
        tokenizer=loaded.tokenizer,
    )


def stop_ids(sample: Sample, loaded: LoadedModel) -> list[int]:
    """The model's stop tokens plus the last token of each of the sample's stop strings (LongBench samsum)."""
    extra = [loaded.tokenizer.encode(text, add_special_tokens=False)[-1] for text in sample.stop_strings]
    return [*loaded.stop_token_ids, *extra]


def sample_row(engine: Engine, sample: Sample, loaded: LoadedModel) -> Row:
    """A generated sample prefilled by ``engine`` (:meth:`~kvbench.engine.Engine.prefilled_row`): its row to decode."""
    return engine.prefilled_row(
        sample.input_ids, sample.max_new_tokens, stop_ids(sample, loaded), sample.min_new_tokens, sample.question_start
    )


def run_sample(engine: Engine, task: Task, sample: Sample, loaded: LoadedModel) -> tuple[dict[str, Any], Any]:
    """Run one sample through the engine and score it: the record written to predictions.jsonl, and the
    engine's output."""
    started = time.perf_counter()
    output: PerplexityOutput | GenerationOutput
    if sample.mode == "perplexity":
        output = engine.perplexity(sample.input_ids, sample.context_tokens)
    else:
        output = decode_rows([sample_row(engine, sample, loaded)], 1)[0]
    return record_of(task, sample, output, loaded, time.perf_counter() - started), output


def run_samples(
    engine: Engine, task: Task, samples: list[Sample], loaded: LoadedModel, batch_size: int
) -> Iterator[tuple[Sample, tuple[dict[str, Any], Any]]]:
    """:func:`run_sample` of each of ``samples``, in their order as each finishes: the generated ones prefilled one
    by one (the questions of one context from one compression of it, :func:`context_rows`) and decoded together,
    ``batch_size`` rows at a time (:func:`~kvbench.engine.rows.finished_rows`; perplexity samples one by one)."""
    if len(samples) == 1 or any(sample.mode == "perplexity" for sample in samples):
        for sample in samples:
            yield sample, run_sample(engine, task, sample, loaded)
        return
    rows = [row for group in context_groups(samples) for row in context_rows([engine], group, loaded, 1)]
    positions = list(range(len(samples)))
    for position, finished in in_sample_order(finished_rows(rows, batch_size), positions, len(samples)):
        ((_, output),) = finished
        yield samples[position], (record_of(task, samples[position], output, loaded), output)


def context_groups(samples: Sequence[Sample], key: Callable[[Sample], Any] = lambda sample: None) -> list[list[Sample]]:
    """``samples`` in runs of consecutive ones answered from one compression of their context: query-agnostic samples
    of one ``context_id`` (and one ``key``: the runs that lack them, in a group); every other sample alone."""
    groups: list[list[Sample]] = []
    for sample in samples:
        previous = groups[-1][-1] if groups else None
        if previous is not None and shares_context(previous, sample) and key(previous) == key(sample):
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def shares_context(sample: Sample, other: Sample) -> bool:
    """Whether two query-agnostic samples ask about one context: one ``context_id`` and the same context tokens (a
    LongBench prompt cut to its length keeps more or less of a context by the length of its question)."""
    if sample.question_start is None or other.question_start is None or sample.context_id is None:
        return False
    same_tokens = sample.input_ids[: sample.question_start] == other.input_ids[: other.question_start]
    return sample.context_id == other.context_id and same_tokens


def context_rows(engines: list[Engine], samples: list[Sample], loaded: LoadedModel, batch_size: int) -> list[Row]:
    """The prefilled rows of ``samples`` (one :func:`context_groups` group) for each of ``engines`` (one model and
    regime), sample by sample: each sample prefilled once for all the engines
    (:func:`~kvbench.engine.shared.prefill_shared`), or the questions of one context answered from one compression of
    it per engine (:func:`~kvbench.engine.shared.prefill_questions`)."""
    if len(samples) == 1:
        (sample,) = samples
        if len(engines) == 1:
            return [sample_row(engines[0], sample, loaded)]
        stops, new, least = stop_ids(sample, loaded), sample.max_new_tokens, sample.min_new_tokens
        return prefill_shared(engines, sample.input_ids, new, stops, least, batch_size, sample.question_start)
    questions = [
        Question(
            sample.input_ids,
            cast(int, sample.question_start),
            sample.max_new_tokens,
            stop_ids(sample, loaded),
            sample.min_new_tokens,
        )
        for sample in samples
    ]
    return prefill_questions(engines, questions, batch_size)


def in_sample_order(
    finished: Iterable[tuple[int, Any]], sample_of: list[int], samples: int
) -> Iterator[tuple[int, list[tuple[int, Any]]]]:
    """Rows' outputs ``(row, output)``, finishing in any order, grouped by sample: ``(sample position, its rows'
    outputs)`` for each of ``samples`` positions in order, once all its rows (``sample_of[row]`` is a row's sample
    position; a sample without rows has none) have finished."""
    remaining = Counter(sample_of)
    outputs: dict[int, list[tuple[int, Any]]] = {}
    position = 0
    for row, output in finished:
        outputs.setdefault(sample_of[row], []).append((row, output))
        remaining[sample_of[row]] -= 1
        while position < samples and remaining[position] == 0:
            yield position, outputs.pop(position, [])
            position += 1
    for left in range(position, samples):
        yield left, outputs.pop(left, [])


def samples_batch(cfg: DictConfig, engines: Sequence[Engine], samples: Sequence[Sample]) -> int:
    """The rows decoding together (``engine.batch_size``: :func:`~kvbench.engine.rows.batch_rows`, for the longest
    prompt and answer of ``samples``)."""
    longest = max((len(sample.input_ids) for sample in samples), default=1)
    answer = max((sample.max_new_tokens for sample in samples), default=0)
    return batch_rows(cfg.engine.batch_size, engines, longest, answer)


def chunks(samples: Sequence[Sample], size: int) -> Iterator[list[Sample]]:
    """``samples`` in consecutive lists of ``size``, or more where a list would split the questions of one context
    (:func:`context_groups`)."""
    chunk: list[Sample] = []
    for group in context_groups(samples):
        if chunk and len(chunk) >= size:
            yield chunk
            chunk = []
        chunk += group
    if chunk:
        yield chunk


def record_of(
    task: Task,
    sample: Sample,
    output: GenerationOutput | PerplexityOutput,
    loaded: LoadedModel,
    seconds: float | None = None,
) -> dict[str, Any]:
    """The predictions.jsonl record of ``sample`` from the engine's output (``seconds``: the sample's time; by default
    its prefill and decode, shares of the forwards it shared)."""
    seconds = output.prefill_seconds + output.decode_seconds if seconds is None else seconds
    result: list[float] | str  # the perplexity task's NLLs, or the decoded text
    if isinstance(output, PerplexityOutput):
        result = output.nlls
    else:
        result = str(loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True))
    record = {"id": sample.id, "subtask": sample.subtask, **task.evaluate(sample, result), "answers": sample.answers}
    if sample.context_id is not None:
        record["context_id"] = sample.context_id
    record["prompt_tokens"] = len(sample.input_ids)
    record["kv"] = asdict(output.kv)
    record["policy_stats"] = output.policy_stats
    record["timing"] = {
        "prefill_seconds": output.prefill_seconds,
        "decode_seconds": output.decode_seconds,
        "total_seconds": seconds,
    }
    if isinstance(output, GenerationOutput) and output.prefill_shared_by > 1:  # a share of one shared forward
        record["timing"]["prefill_shared_by"] = output.prefill_shared_by
    if isinstance(output, GenerationOutput) and output.context_shared_by > 1:  # a share of one context's compression
        record["timing"]["context_shared_by"] = output.context_shared_by
    if isinstance(output, GenerationOutput) and output.scoring_seconds > 0:  # of prefill: reconstructing the context
        record["timing"]["scoring_seconds"] = output.scoring_seconds
    return record


def mean_policy_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over samples of each policy statistic (e.g. CaliDrop's recomputation rate), element-wise for lists."""
    stats = [record.get("policy_stats") or {} for record in records]
    merged: dict[str, Any] = {}
    for name in sorted({key for entry in stats for key in entry}):
        values = [entry[name] for entry in stats if name in entry]
        if all(isinstance(value, (int, float)) for value in values):
            merged[name] = mean(values)
        elif all(isinstance(value, list) for value in values) and len({len(value) for value in values}) == 1:
            merged[name] = [mean(column) for column in zip(*values)]
    return merged


def summarize(
    job: Job, task: Task, records: list[dict[str, Any]], load: tuple[float, int] = (0.0, 1)
) -> dict[str, Any]:
    """metrics.json: task scores (0–100), KV-cache sizes (max over samples) and summed timings: the records' own
    decode, their prefill (a shared prefill's share), and the job's share of ``load`` (the seconds this process
    took to load the model and build the samples, and how many jobs of a group they served)."""
    cfg, scores = job.cfg, task.aggregate(records)
    average = scores["ppl"] if "ppl" in scores else (mean(scores.values()) if scores else None)
    kv = [record["kv"] for record in records]
    return {
        "model": cfg.model.name,
        "policy": cfg.policy.name,
        "label": job.policy.label,
        "budget": str(cfg.budget.spec),
        "task": cfg.task.name,
        "regime": cfg.engine.regime,
        "scores": scores,
        "average": average,
        "num_samples": len(records),
        "kv_cache": {
            "after_prefill_tokens_per_layer": [
                max(column) for column in zip(*(k["after_prefill_tokens_per_layer"] for k in kv))
            ],
            "peak_tokens_per_layer": [max(column) for column in zip(*(k["peak_tokens_per_layer"] for k in kv))],
            "peak_bytes": max((k["peak_bytes"] for k in kv), default=0),
            "full_bytes": max((k["full_bytes"] for k in kv), default=0),
        },
        "policy_stats": mean_policy_stats(records),
        "timing": {
            **{
                name: sum(record["timing"][name] for record in records)
                for name in ("prefill_seconds", "decode_seconds", "total_seconds")
            },
            "prefill_shared_by": mean([record["timing"].get("prefill_shared_by", 1) for record in records] or [1]),
            **(
                {"scoring_seconds": sum(record["timing"].get("scoring_seconds", 0.0) for record in records)}
                if any("scoring_seconds" in record["timing"] for record in records)
                else {}
            ),
            "load_seconds": load[0] / load[1],
            "load_shared_by": load[1],
        },
    }


@dataclass
class Shared:
    """What the jobs of a group share (:func:`run_group`): the model, the task and its samples, loaded by the
    first job that has samples to run (a group whose jobs are all finished loads nothing). A single run has
    its own."""

    loaded: LoadedModel | None = None
    task: Task | None = None
    samples: list[Sample] = field(default_factory=list)
    load_seconds: float = 0.0  # of the model load and the samples' building
    jobs: int = 1  # the jobs of the group, among which the load is shared
    error: KVBenchError | None = None  # why the task could not be built: every job of the group fails with it
    sweep: SweepProgress | None = None  # the progress of the sweep the group is part of, if it says one

    def task_samples(self, cfg: DictConfig) -> tuple[Task, list[Sample]]:
        """The task and samples of ``cfg``, built for the model's tokenizer, the model not loaded; every reason the
        job cannot run here is found first (the first call builds them; the jobs of a group share model, task and
        data settings, so later calls return the same, or raise the same error)."""
        if self.error is not None:
            raise self.error
        if self.task is None:
            started = time.perf_counter()
            set_threads(cfg.engine.threads)
            tokenizer = local_tokenizer(cfg.model)
            task, reasons = checked_task(cfg, tokenizer_or_stand_in(cfg.model, tokenizer))
            if task is None:
                self.error = KVBenchError("; ".join(reasons))
                raise self.error
            try:
                if tokenizer is None:  # checked with a stand-in: the model's own, downloadable, builds the samples
                    task = build_task(cfg, load_tokenizer(cfg.model))
                self.samples = list(task.samples())
            except KVBenchError as error:
                self.error = error
                raise
            self.task = task
            self.load_seconds += time.perf_counter() - started
        return self.task, self.samples

    def model(self, cfg: DictConfig) -> LoadedModel:
        """The model of ``cfg``, loaded once (after :meth:`task_samples` has checked the job)."""
        if self.loaded is None:
            started = time.perf_counter()
            self.loaded = load_model(cfg.model)
            self.load_seconds += time.perf_counter() - started
        return self.loaded


def run(cfg: DictConfig, output_dir: str | Path, shared: Shared | None = None) -> dict[str, Any]:
    """Run (or resume) the configured job into ``output_dir``; returns the metrics. The job is resolved
    first (:func:`kvbench.job.resolve`); the run holds the directory's lock (:meth:`RunDir.lock`: a second
    process on it refuses); a directory holding other settings is refused (unless ``resume=restart``); a
    finished run of the same settings is not run again. Nothing is written to the directory before the
    task's samples are built: a job that fails before that leaves it as it was. ``shared``: the model and
    samples of the job's group, if it runs in one."""
    job, run_dir = job_and_directory(cfg, output_dir)
    with run_dir.lock():
        return run_locked(job, run_dir, shared or Shared())


def job_and_directory(cfg: DictConfig, output_dir: str | Path) -> tuple[Job, RunDir]:
    """The resolved job and its run directory, the job's ``output_dir`` the directory it is written to, whatever
    named it."""
    job = resolve(cfg)
    run_dir = RunDir(output_dir)
    job.cfg.output_dir = str(run_dir.path)
    return job, run_dir


def run_locked(job: Job, run_dir: RunDir, shared: Shared) -> dict[str, Any]:
    """:func:`run`, its run directory's lock held."""
    opened = open_run(job, run_dir, shared)
    if isinstance(opened, dict):
        return opened
    batch = samples_batch(job.cfg, [opened.engine], opened.pending)
    for chunk in chunks(opened.pending, batch):
        for sample, (record, output) in run_samples(opened.engine, opened.task, chunk, opened.loaded, batch):
            opened.write(sample, record, output)
    return opened.finish()


@dataclass
class OpenRun:
    """A run whose directory is started (its lock held): what it still has to run and where it writes."""

    job: Job
    run_dir: RunDir
    loaded: LoadedModel
    engine: Engine
    task: Task
    records: list[dict[str, Any]]
    pending: list[Sample]
    progress: Progress
    load: tuple[float, int]  # the seconds of its process's model load and sample building, and the jobs sharing them

    def write(self, sample: Sample, record: dict[str, Any], output: Any) -> None:
        """One finished sample: its kept sets (``engine.save_kept``), then its line in predictions.jsonl."""
        if getattr(output, "kept", None) is not None:
            self.run_dir.write_kept(sample.id, sample.input_ids, output.kept)
        self.run_dir.append(record)
        self.records.append(record)
        self.progress.advance()

    def finish(self) -> dict[str, Any]:
        """metrics.json from every record (and W&B, if configured); returns the metrics."""
        self.progress.close()
        metrics = summarize(self.job, self.task, self.records, self.load)
        self.run_dir.write_metrics(metrics)
        log_run(self.job.cfg, self.run_dir, metrics, self.records)
        return metrics


def first_samples(run_dir: RunDir, cfg: DictConfig, samples: list[Sample]) -> list[dict[str, Any]] | None:
    """The records of ``samples`` where the directory holds a finished run of more samples (its ``task.num_samples``
    larger than ``cfg``'s, or null: all), every one of these among its records; else None. A run asked for fewer
    samples than its directory holds reads its first ones and writes nothing (a task's samples are prefix-stable)."""
    saved = (run_dir.saved_config() or {}).get("task", {}).get("num_samples")
    asked = cfg.task.get("num_samples")
    if not run_dir.metrics_path.exists() or asked is None or saved is not None and saved <= asked:
        return None
    records = {record["id"]: record for record in run_dir.records()}
    return [records[sample.id] for sample in samples] if all(sample.id in records for sample in samples) else None


def open_run(job: Job, run_dir: RunDir, shared: Shared) -> OpenRun | dict[str, Any]:
    """Check the directory (same settings; a finished run's metrics are returned as they are), load what the run
    needs (from ``shared``), move an earlier run aside with ``resume=restart``, write config.yaml and read back the
    finished samples."""
    restart = job.cfg.resume == "restart"
    if not restart:
        run_dir.check_same_run(config_dict(job.cfg, resolve=True))
        finished_before = finished_metrics(run_dir, job.cfg)
        if finished_before is not None:
            print(f"kvbench: {run_dir.path}: finished with these settings, nothing to run", file=sys.stderr)
            return finished_before
    task, samples = shared.task_samples(job.cfg)
    if not samples:
        raise KVBenchError(f"task {job.cfg.task.name} has no samples with these settings")
    if not restart:
        first = first_samples(run_dir, job.cfg, samples)
        if first is not None:
            print(f"kvbench: {run_dir.path}: holds these {len(first)} samples of a larger run, nothing to run or write",
                  file=sys.stderr)  # fmt: skip
            return summarize(job, task, first)
    loaded = shared.model(job.cfg)
    engine = build_engine(job, loaded)
    if restart:
        moved = run_dir.move_aside()
        if moved is not None:
            log.info("resume=restart: the earlier files of %s moved to %s", run_dir.path, moved)
    run_dir.start(job.cfg)
    wanted = {sample.id for sample in samples}
    records = [record for record in run_dir.records() if record["id"] in wanted]  # a larger run's others stay
    finished = {record["id"] for record in records}
    samples = [sample for sample in samples if sample.id not in finished]
    state = f"resuming, {len(finished)} samples done" if finished else "new run"
    prompt_tokens = sum(len(sample.input_ids) for sample in samples)
    log.info("writing %s (%s, %d to go: %d prompt tokens)", run_dir.path, state, len(samples), prompt_tokens)
    cfg = job.cfg
    progress = Progress(len(samples), f"{cfg.task.name} {cfg.policy.name}@{cfg.budget.spec}", sweep=shared.sweep)
    load = (shared.load_seconds, shared.jobs)
    return OpenRun(job, run_dir, loaded, engine, task, records, samples, progress, load)


def group_key(cfg: DictConfig) -> str:
    """What the jobs of one group share: every identity setting but the policy and the budget (same model,
    task, data, regime and engine settings) and the samples asked for, so one model load and one task's samples
    serve them all."""
    settings = identity(config_dict(cfg, resolve=True))
    shared = {key: value for key, value in settings.items() if key not in GROUPED}
    return json.dumps({**shared, "num_samples": cfg.task.get("num_samples")}, sort_keys=True, default=str)


def run_group(
    members: Sequence[tuple[DictConfig, str | Path]], share_prefill: bool = False, sweep: SweepProgress | None = None
) -> list[dict[str, Any] | Exception]:
    """Jobs of one :func:`group_key` in this process, the model loaded and the task's samples built once
    (:class:`Shared`): one after another, or with ``share_prefill`` sample by sample, every job that lacks the
    sample generating it from one shared oneshot prefill (:func:`kvbench.engine.shared.generate_shared`). Each
    job keeps all a single run has: its run directory, lock, resume, ``config.yaml``, records and its log
    (``kvbench.log`` in its directory). A job that fails is logged there and does not stop the others. Returns
    each job's metrics, or the error it failed with. ``sweep``: the progress of the sweep it is part of."""
    shared = Shared(jobs=len(members), sweep=sweep)
    outcomes: list[dict[str, Any] | Exception | None] = [None] * len(members)
    logs = [Path(output_dir) / "kvbench.log" for _, output_dir in members]
    with contextlib.ExitStack() as locks:  # with share_prefill, every run's lock is held until the group ends
        opened: dict[int, OpenRun] = {}
        for index, (cfg, output_dir) in enumerate(members):
            with job_log(logs[index]), failure(outcomes, index):
                if not share_prefill:
                    metrics = run(cfg, output_dir, shared)
                    outcomes[index] = metrics
                    print(result_line(metrics), flush=True)
                    continue
                job, run_dir = job_and_directory(cfg, output_dir)
                locks.enter_context(run_dir.lock())
                started = open_run(job, run_dir, shared)
                if isinstance(started, dict):
                    outcomes[index] = started
                else:
                    opened[index] = started
        if opened:
            run_shared(opened, shared.samples, outcomes, logs)
            for index in opened:
                outcome = outcomes[index]
                if isinstance(outcome, dict):
                    print(result_line(outcome), flush=True)
    assert all(outcome is not None for outcome in outcomes)  # each job finished, was finished, or failed
    return cast(list[dict[str, Any] | Exception], outcomes)


def run_shared(opened: dict[int, OpenRun], samples: list[Sample], outcomes: list[Any], logs: list[Path]) -> None:
    """The ``samples`` of the ``opened`` runs of a group, each prefilled once for every run that lacks it
    (:func:`~kvbench.engine.shared.prefill_shared`), the (sample, run) rows of as many samples as ``engine.batch_size``
    holds decoding together, each sample's records written once its rows have finished, in sample order
    (:func:`decode_shared`); a run whose sample fails is logged and dropped (its outcome the error), the others go
    on."""
    first = next(iter(opened.values()))
    pending = {index: {sample.id for sample in run.pending} for index, run in opened.items()}
    todo = [sample for sample in samples if any(sample.id in ids for ids in pending.values())]
    batch = samples_batch(first.job.cfg, [run.engine for run in opened.values()], todo)
    for chunk in chunks(todo, max(1, batch // len(opened))):
        lacking = {
            sample.id: {
                index: run for index, run in opened.items() if outcomes[index] is None and sample.id in pending[index]
            }
            for sample in chunk
        }
        written: set[str] = set()
        try:
            for sample, results in decode_shared(chunk, lacking, first.loaded, batch):
                write_sample(sample, lacking[sample.id], results, outcomes, logs)
                written.add(sample.id)
        except Exception as error:  # one variant failed the shared pass: each runs the rest of the chunk alone
            log.warning("shared pass failed; the chunk's other samples run alone", exc_info=True)
            message = f"shared pass failed ({type(error).__name__}: {error}); its samples run alone"
            warnings.warn(message, SharedPassWarning, stacklevel=2)
        for sample in chunk:
            if sample.id not in written:
                write_sample(sample, lacking[sample.id], {}, outcomes, logs)
    for index, run in opened.items():
        if outcomes[index] is None:
            with job_log(logs[index]), failure(outcomes, index):
                outcomes[index] = run.finish()


def write_sample(
    sample: Sample,
    runs: dict[int, OpenRun],
    results: dict[int, tuple[dict[str, Any], Any]],
    outcomes: list[Any],
    logs: list[Path],
) -> None:
    """Each of ``runs``' record of ``sample`` (from ``results``, else the run runs it alone), written to its run
    directory; a run that fails here is logged and dropped."""
    for index, run in runs.items():
        if outcomes[index] is not None:  # failed on an earlier sample
            continue
        with job_log(logs[index]), failure(outcomes, index):
            record, output = (
                results[index] if index in results else run_sample(run.engine, run.task, sample, run.loaded)
            )
            run.write(sample, record, output)


def decode_shared(
    chunk: list[Sample], lacking: dict[str, dict[int, OpenRun]], loaded: LoadedModel, batch_size: int
) -> Iterator[tuple[Sample, dict[int, tuple[dict[str, Any], Any]]]]:
    """Each sample of ``chunk`` in order with the records and outputs of the runs that lack it, by run, as soon as its
    rows have finished: each sample prefilled once for its runs (the questions of one context answered from one
    compression of it per run, :func:`context_rows`), all the chunk's rows decoded together,
    ``batch_size`` at a time (:func:`~kvbench.engine.rows.finished_rows`); a perplexity sample's text streamed by
    its runs as rows (:func:`~kvbench.engine.rows.perplexity_rows`)."""
    results: dict[int, dict[int, tuple[dict[str, Any], Any]]] = {}  # sample position -> run -> (record, output)
    rows: list[Row] = []
    owners: list[tuple[int, list[tuple[int, OpenRun]]]] = []  # each row's sample position and its runs (twins)
    position_of = {sample.id: position for position, sample in enumerate(chunk)}
    for samples in context_groups(chunk, lambda sample: lacking[sample.id].keys()):  # the same runs lack them
        runs = lacking[samples[0].id]
        if not runs:
            continue
        if samples[0].mode == "perplexity":
            (sample,) = samples
            outputs = perplexity_rows(
                [run.engine for run in runs.values()], sample.input_ids, sample.context_tokens, batch_size
            )
            results[position_of[sample.id]] = {
                index: (record_of(run.task, sample, output, run.loaded), output)
                for (index, run), output in zip(runs.items(), outputs)
            }
            continue
        twins: dict[tuple[str, str | None], list[tuple[int, OpenRun]]] = {}
        for index, run in runs.items():
            twins.setdefault(twin_key(run.engine), []).append((index, run))
        computed = [twin[0][1].engine for twin in twins.values()]
        rows += context_rows(computed, samples, loaded, batch_size)
        owners += [(position_of[sample.id], twin) for sample in samples for twin in twins.values()]
    sample_of = [position for position, _ in owners]
    for position, finished in in_sample_order(finished_rows(rows, batch_size), sample_of, len(chunk)):
        sample = chunk[position]
        for row, output in finished:
            for index, run in owners[row][1]:
                results.setdefault(position, {})[index] = (record_of(run.task, sample, output, run.loaded), output)
        yield sample, results.pop(position, {})


def twin_key(engine: Engine) -> tuple[str, str | None]:
    """The runs of a group (one :func:`group_key`: all settings alike but policy and budget) with the same key compute
    the same thing, so :func:`decode_shared` computes it once for all of them: the policy's settings and modifiers, and
    its budget unless it never evicts (``full`` at any budget is one full-cache run)."""
    policy = engine.policy
    return policy.key, engine.budget.spec if policy.evicts else None


@contextlib.contextmanager
def failure(outcomes: list[Any], index: int) -> Iterator[None]:
    """An error inside the block is job ``index``'s outcome, logged in its log; the group goes on."""
    try:
        yield
    except KVBenchError as error:
        log.error("kvbench: error: %s", error)
        outcomes[index] = error
    except Exception as error:
        log.exception("job failed")
        outcomes[index] = error


@contextlib.contextmanager
def job_log(path: Path) -> Iterator[None]:
    """Log lines at INFO and above also to ``path`` (created at its first line, its folder now), as Hydra's
    job logging does for a job of a sweep."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def rounded(value: Any) -> Any:
    """Scores as printed: 2 decimals (metrics.json keeps full precision)."""
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    return value


def result_line(metrics: dict[str, Any]) -> str:
    """The JSON line a finished job prints: what ran and its scores, rounded."""
    return json.dumps(
        rounded({key: metrics[key] for key in ("model", "policy", "budget", "task", "scores", "average")})
    )
