"""A group: the jobs of a sweep that differ only in policy and budget, one model load, each sample prefilled once
for all of them and their rows decoded together."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig

from kvbench.engine.rows import Row, RowGroup, finished_rows, perplexity_rows
from kvbench.engine.shared import repeats_kv
from kvbench.errors import SharedPassWarning
from kvbench.identity import computation_key
from kvbench.models import LoadedModel
from kvbench.run.lifecycle import OpenRun, Shared, failure, job_and_directory, job_log, open_run
from kvbench.run.progress import SweepProgress
from kvbench.run.records import record_of, result_line
from kvbench.run.schedule import (
    chunks,
    context_groups,
    context_rows,
    draw_parts,
    in_sample_order,
    one_prompts_draws,
    run_sample,
    samples_batch,
)
from kvbench.tasks.base import Sample

#: variants of a sample decoded from one prefill: each variant's runs (twins: one computation)
Piece = list[list[tuple[int, OpenRun]]]
log = logging.getLogger("kvbench.run")  # one logger for the run layer (the jobs' log lines name it)


#: what runs each of a group's steps for run ``index``: its failures caught (:func:`guarded`), or raised (one job)
Guard = Callable[[int], AbstractContextManager[None]]


def run(cfg: DictConfig, output_dir: str | Path, shared: Shared | None = None) -> dict[str, Any]:
    """Run (or resume) the configured job into ``output_dir``; returns the metrics. The job is resolved
    first (:func:`kvbench.job.resolve`); the run holds the directory's lock (:meth:`RunDir.lock`: a second
    process on it refuses); a directory holding other settings is refused (unless ``resume=restart``); a
    finished run of the same settings is not run again. Nothing is written to the directory before the
    task's samples are built: a job that fails before that leaves it as it was. ``shared``: the model and
    samples of the job's group, if it runs in one. The job runs as a group of one (:func:`run_opened`), its
    error raised."""
    job, run_dir = job_and_directory(cfg, output_dir)
    with run_dir.lock():
        opened = open_run(job, run_dir, shared or Shared())
        if isinstance(opened, dict):
            return opened
        outcomes: list[Any] = [None]
        run_opened({0: opened}, opened.pending, outcomes, lambda index: contextlib.nullcontext())
        return outcomes[0]


@contextlib.contextmanager
def guarded(log_path: Path, outcomes: list[Any], index: int) -> Iterator[None]:
    """Run ``index`` of a group: its lines also in its own log, an error its outcome (the group goes on)."""
    with job_log(log_path), failure(outcomes, index):
        yield


def run_group(
    members: Sequence[tuple[DictConfig, str | Path]], share_prefill: bool = False, sweep: SweepProgress | None = None
) -> list[dict[str, Any] | Exception]:
    """Jobs of one :func:`~kvbench.identity.load_group_key` in this process, the model loaded and the task's samples
    built once (:class:`Shared`): one after another, or with ``share_prefill`` sample by sample, every job that lacks
    the sample generating it from one shared oneshot prefill (:func:`kvbench.engine.shared.generate_shared`). Each
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
            run_opened(opened, shared.samples, outcomes, lambda index: guarded(logs[index], outcomes, index))
            for index in opened:
                outcome = outcomes[index]
                if isinstance(outcome, dict):
                    print(result_line(outcome), flush=True)
    assert all(outcome is not None for outcome in outcomes)  # each job finished, was finished, or failed
    return cast(list[dict[str, Any] | Exception], outcomes)


def run_opened(opened: dict[int, OpenRun], samples: list[Sample], outcomes: list[Any], guard: Guard) -> None:
    """The ``samples`` of the ``opened`` runs of a group (one job: a group of one), each prefilled once for every run
    that lacks it (:func:`~kvbench.engine.shared.prefill_shared`) once its rows fit, the (sample, run) rows of
    ``engine.batch_size`` samples at a time decoding together, ``engine.batch_size`` rows a step, each sample's
    records written once its rows have finished, in sample order (:func:`decode_shared`), then each run finished (its
    metrics its outcome). A run's step runs under ``guard``: in a group, a run whose sample fails is logged and
    dropped (its outcome the error), the others go on."""
    first = next(iter(opened.values()))
    pending = {index: {sample.id for sample in run.pending} for index, run in opened.items()}
    todo = [sample for sample in samples if any(sample.id in ids for ids in pending.values())]
    batch = samples_batch(first.job.cfg, [run.engine for run in opened.values()], todo)
    for chunk in chunks(todo, batch):
        lacking = {
            sample.id: {
                index: run for index, run in opened.items() if outcomes[index] is None and sample.id in pending[index]
            }
            for sample in chunk
        }
        written: set[str] = set()
        try:
            for sample, results in decode_shared(chunk, lacking, first.loaded, batch):
                write_sample(sample, lacking[sample.id], results, outcomes, guard)
                written.add(sample.id)
        except Exception as error:
            if len(opened) == 1:  # a group of one shares no pass: the error is its run's (raised, or its outcome)
                (only,) = opened
                with guard(only):
                    raise
                break
            # one variant failed the shared pass: each runs the rest of the chunk alone
            log.warning("shared pass failed; the chunk's other samples run alone", exc_info=True)
            message = f"shared pass failed ({type(error).__name__}: {error}); its samples run alone"
            warnings.warn(message, SharedPassWarning, stacklevel=2)
        for sample in chunk:
            if sample.id not in written:
                write_sample(sample, lacking[sample.id], {}, outcomes, guard)
    for index, run in opened.items():
        if outcomes[index] is None:
            with guard(index):
                outcomes[index] = run.finish()


def write_sample(
    sample: Sample,
    runs: dict[int, OpenRun],
    results: dict[int, tuple[dict[str, Any], Any]],
    outcomes: list[Any],
    guard: Guard,
) -> None:
    """Each of ``runs``' record of ``sample`` (from ``results``, else the run runs it alone), written to its run
    directory, under ``guard``."""
    for index, run in runs.items():
        if outcomes[index] is not None:  # failed on an earlier sample
            continue
        with guard(index):
            record, output = (
                results[index] if index in results else run_sample(run.engine, run.task, sample, run.loaded)
            )
            run.write(sample, record, output)


def decode_shared(
    chunk: list[Sample], lacking: dict[str, dict[int, OpenRun]], loaded: LoadedModel, batch_size: int
) -> Iterator[tuple[Sample, dict[int, tuple[dict[str, Any], Any]]]]:
    """Each sample of ``chunk`` in order with the records and outputs of the runs that lack it, by run, as soon as its
    rows have finished: each sample prefilled once for its runs (the questions of one context answered from one
    compression of it per run, :func:`context_rows`) once its rows fit in the batch, the chunk's rows decoded
    together, ``batch_size`` at a time (:func:`~kvbench.engine.rows.finished_rows`: a sample's rows join as those
    before them finish); a perplexity sample's text streamed by its runs as rows
    (:func:`~kvbench.engine.rows.perplexity_rows`)."""
    results: dict[int, dict[int, tuple[dict[str, Any], Any]]] = {}  # sample position -> run -> (record, output)
    sample_of: list[int] = []  # each row's sample position
    owners: list[list[tuple[int, OpenRun]]] = []  # each row's runs (twins)
    made = 0  # the positions whose rows are made
    position_of = {sample.id: position for position, sample in enumerate(chunk)}

    def group_rows(samples: list[Sample]) -> list[RowGroup]:
        """The rows of one context group, made on demand in pieces of at most ``batch_size`` rows (each piece
        prefilled by its own shared forward, so the rows held are the batch's, whatever the number of variants): how
        many each has, and what prefills it."""
        positions = [position_of[sample.id] for sample in samples]
        runs = lacking[samples[0].id]
        if runs and samples[0].mode == "perplexity":
            return [(0, lambda: streamed(samples, positions, runs))]
        twins: dict[tuple[str, str | None], list[tuple[int, OpenRun]]] = {}
        for index, run in runs.items():
            twins.setdefault(computation_key(run.engine.policy, run.engine.budget.spec), []).append((index, run))
        # one head layout a piece (one forward each); pieces as even as the batch allows
        ordered = sorted(twins.values(), key=lambda twin: repeats_kv(twin[0][1].engine.policy))
        drawn = one_prompts_draws(samples)
        spans = even_pieces(len(ordered), batch_size, 1 if drawn else len(samples))
        pieces = [ordered[begin : begin + size] for begin, size in spans] or [[]]  # no runs: no rows, made all the same
        parts: list[tuple[Piece, range, Callable[[], list[Row]]]] = []  # a piece's rows of the samples at places
        for piece in pieces:
            engines = [twin[0][1].engine for twin in piece]
            if drawn and piece:  # the draws in parts that fit the batch, from one prefill
                parts += [(piece, places, rows) for places, rows in draw_parts(engines, samples, loaded, batch_size)]
            else:
                rows = functools.partial(context_rows, engines, samples, loaded, batch_size) if piece else list
                parts.append((piece, range(len(samples)), rows))

        def make(piece: Piece, places: range, rows: Callable[[], list[Row]], last: bool) -> list[Row]:
            nonlocal made
            made_rows = rows()
            sample_of.extend(positions[place] for place in places for _ in piece)
            owners.extend(twin for _ in places for twin in piece)
            if last:
                made = positions[-1] + 1
            return made_rows

        return [
            (len(places) * len(piece), functools.partial(make, piece, places, rows, number == len(parts) - 1))
            for number, (piece, places, rows) in enumerate(parts)
        ]

    def streamed(samples: list[Sample], positions: list[int], runs: dict[int, OpenRun]) -> list[Row]:
        """A perplexity sample's text streamed by its runs as rows: no rows to decode."""
        nonlocal made
        (sample,) = samples
        outputs = perplexity_rows(
            [run.engine for run in runs.values()], sample.input_ids, sample.context_tokens, batch_size
        )
        results[positions[0]] = {
            index: (record_of(run.task, sample, output, run.loaded), output)
            for (index, run), output in zip(runs.items(), outputs)
        }
        made = positions[-1] + 1
        return []

    groups = (
        group
        for samples in context_groups(chunk, lambda sample: lacking[sample.id].keys())
        for group in group_rows(samples)
    )
    finished = finished_rows([], batch_size, groups)
    for position, done in in_sample_order(finished, sample_of, len(chunk), lambda: made):
        sample = chunk[position]
        for row, output in done:
            for index, run in owners[row]:
                results.setdefault(position, {})[index] = (record_of(run.task, sample, output, run.loaded), output)
        yield sample, results.pop(position, {})


def even_pieces(count: int, batch_size: int, questions: int = 1) -> list[tuple[int, int]]:
    """``count`` variants in as few pieces as keep a piece's rows (``questions`` each) within ``batch_size``, as even
    as that allows: ``(begin, size)`` of each."""
    most = max(1, batch_size // max(questions, 1))
    number = -(-count // most)
    if not number:
        return []
    bounds = [piece * count // number for piece in range(number + 1)]
    return [(begin, end - begin) for begin, end in zip(bounds, bounds[1:])]
