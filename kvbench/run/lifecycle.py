"""A run's life: resolved, its directory locked, opened (finished samples kept), run, finished; the model and samples
a group shares."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvbench import config_dict
from kvbench.engine import Engine
from kvbench.engine.threads import set_threads
from kvbench.errors import KVBenchError
from kvbench.job import Job, resolve
from kvbench.models import LoadedModel, ModelSpec, load_model, load_tokenizer
from kvbench.results.wandb_logger import log_run
from kvbench.run.factories import build_engine, build_task, checked_task, local_tokenizer, tokenizer_or_stand_in
from kvbench.run.progress import LOG_FORMAT, Progress, SweepProgress
from kvbench.run.records import summarize
from kvbench.rundir import RunDir, finished_metrics
from kvbench.tasks.base import Sample, Task

log = logging.getLogger("kvbench.run")  # one logger for the run layer (the jobs' log lines name it)


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
            model = ModelSpec.of(cfg.model)
            tokenizer = local_tokenizer(model)
            task, reasons = checked_task(cfg, tokenizer_or_stand_in(model, tokenizer))
            if task is None:
                self.error = KVBenchError("; ".join(reasons))
                raise self.error
            try:
                if tokenizer is None:  # checked with a stand-in: the model's own, downloadable, builds the samples
                    task = build_task(cfg, load_tokenizer(model))
                samples = samples_within_window(unique_ids(list(task.samples()), cfg.task.name), cfg)
                self.samples = with_draws(samples, int(cfg.generation.num_samples))
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
            self.loaded = load_model(ModelSpec.of(cfg.model))
            self.load_seconds += time.perf_counter() - started
        return self.loaded


def job_and_directory(cfg: DictConfig, output_dir: str | Path) -> tuple[Job, RunDir]:
    """The resolved job and its run directory, the job's ``output_dir`` the directory it is written to, whatever
    named it."""
    job = resolve(cfg)
    run_dir = RunDir(output_dir)
    job.cfg.output_dir = str(run_dir.path)
    return job, run_dir


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
        log_run(self.job.settings, self.run_dir, metrics, self.records)
        return metrics


def with_draws(samples: list[Sample], count: int) -> list[Sample]:
    """Each generated sample ``count`` times (``generation.num_samples``), draw ``k`` as ``<id>#<k>`` with its problem
    and draw in its metadata (each seeded by its own id: kvbench/engine/sampling.py); ``samples`` as they are for 1."""
    if count == 1:
        return samples
    drawn_samples: list[Sample] = []
    for sample in samples:
        if sample.mode != "generate":  # a perplexity text: nothing drawn
            drawn_samples.append(sample)
            continue
        for draw in range(count):
            metadata = {**sample.metadata, "problem": sample.id, "draw": draw}
            drawn_samples.append(replace(sample, id=f"{sample.id}#{draw}", metadata=metadata))
    return drawn_samples


def unique_ids(samples: list[Sample], task: str) -> list[Sample]:
    """``samples``, refused in one line where two share an id (a run directory keeps one line per id)."""
    counts = Counter(sample.id for sample in samples)
    repeated = [name for name, count in counts.items() if count > 1]
    if repeated:
        more = f" (and {len(repeated) - 1} more)" if len(repeated) > 1 else ""
        raise KVBenchError(f"task {task}: samples share the id {repeated[0]!r}{more}; each sample needs its own id")
    return samples


def samples_within_window(samples: list[Sample], cfg: DictConfig) -> list[Sample]:
    """``samples``, refused in one line where a prompt and the tokens it may generate exceed the model's window
    (a user's ``task.max_length`` or context length too long for the model: the task's defaults leave room)."""
    window = int(cfg.model.context_window)
    for sample in samples:  # (a perplexity text is streamed past the window by design: StreamingLLM's protocol)
        if sample.mode == "generate" and len(sample.input_ids) + sample.max_new_tokens > window:
            raise KVBenchError(
                f"task {cfg.task.name}: sample {sample.id} has {len(sample.input_ids)} prompt tokens and may generate "
                f"{sample.max_new_tokens}, beyond the context window {window} of model {cfg.model.name}; lower "
                "task.max_length or the context length"
            )
    return samples


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
        finished_before = finished_metrics(run_dir, job.settings)
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
    wanted = {sample.id for sample in samples}
    # a larger run's others stay
    records = [record for record in run_dir.start(job.settings, task.required_fields) if record["id"] in wanted]
    finished = {record["id"] for record in records}
    samples = [sample for sample in samples if sample.id not in finished]
    state = f"resuming, {len(finished)} samples done" if finished else "new run"
    prompts = {sample.metadata.get("problem", sample.id): len(sample.input_ids) for sample in samples}
    prompt_tokens = sum(prompts.values())  # a problem's draws share one prefill
    log.info("writing %s (%s, %d to go: %d prompt tokens)", run_dir.path, state, len(samples), prompt_tokens)
    cfg = job.cfg
    label = f"{cfg.task.name} {job.label}@{cfg.budget.spec}"
    progress = Progress(len(samples), label, sweep=shared.sweep)
    load = (shared.load_seconds, shared.jobs)
    return OpenRun(job, run_dir, loaded, engine, task, records, samples, progress, load)


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
