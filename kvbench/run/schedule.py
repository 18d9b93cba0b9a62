"""Scheduling samples: one engine's samples as rows (those sharing a context compressed once), in sample order, in
chunks."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from omegaconf import DictConfig

from kvbench.engine import Engine
from kvbench.engine.rows import Row, batch_rows, decode_rows
from kvbench.engine.runner import GenerationOutput, PerplexityOutput
from kvbench.engine.sampling import draw_seed
from kvbench.engine.shared import Draws, Prompt, prefill_draws, prefill_questions, prefill_shared
from kvbench.models import LoadedModel
from kvbench.run.factories import stop_ids
from kvbench.run.records import record_of
from kvbench.tasks.base import Sample, Task

log = logging.getLogger("kvbench.run")  # one logger for the run layer (the jobs' log lines name it)


def sample_row(engine: Engine, sample: Sample, loaded: LoadedModel) -> Row:
    """A generated sample prefilled by ``engine`` (:meth:`~kvbench.engine.Engine.prefilled_row`): its row to decode."""
    row = engine.prefilled_row(
        sample.input_ids, sample.max_new_tokens, stop_ids(sample, loaded), sample.min_new_tokens, sample.question_start
    )
    return seed_rows([row], [sample])[0]


def seed_rows(rows: list[Row], samples: list[Sample]) -> list[Row]:
    """``rows`` (each sample's, sample by sample, as many each) seeded for their draws where their engine samples:
    from the run's seed and the sample's id, so a sample draws alike alone, in a group or resumed."""
    each = len(rows) // max(len(samples), 1)
    for place, row in enumerate(rows):
        if row.engine.sampling is not None:
            row.seed = draw_seed(row.engine.sampling.seed, samples[place // each].id)
    return rows


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


def context_groups(samples: Sequence[Sample], key: Callable[[Sample], Any] = lambda sample: None) -> list[list[Sample]]:
    """``samples`` in runs of consecutive ones answered from one compression of their context (and of one ``key``:
    the runs that lack them, in a group): query-agnostic samples of one ``context_id``, and the draws of one problem;
    every other sample alone."""
    groups: list[list[Sample]] = []
    for sample in samples:
        previous = groups[-1][-1] if groups else None
        if previous is not None and key(previous) == key(sample) and one_compression(previous, sample):
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def one_compression(sample: Sample, other: Sample) -> bool:
    """Whether two samples are answered from one compression: of their context, or of the prompt they draw from."""
    return shares_context(sample, other) or same_draws(sample, other)


def shares_context(sample: Sample, other: Sample) -> bool:
    """Whether two query-agnostic samples ask about one context: one ``context_id`` and the same context tokens (a
    LongBench prompt cut to its length keeps more or less of a context by the length of its question)."""
    if sample.question_start is None or other.question_start is None or sample.context_id is None:
        return False
    same_tokens = sample.input_ids[: sample.question_start] == other.input_ids[: other.question_start]
    return sample.context_id == other.context_id and same_tokens


def same_draws(sample: Sample, other: Sample) -> bool:
    """Whether two samples are draws of one problem (``generation.num_samples``): one prompt, prefilled alike."""
    problem = sample.metadata.get("problem")
    same_prompt = sample.input_ids == other.input_ids and sample.question_start == other.question_start
    return problem is not None and problem == other.metadata.get("problem") and same_prompt


def one_prompts_draws(samples: Sequence[Sample]) -> bool:
    """Whether a :func:`context_groups` group is the draws of one prompt (:func:`same_draws`), not one sample or the
    questions of one context."""
    return len(samples) > 1 and samples[0].question_start is None


def sample_prompt(sample: Sample, loaded: LoadedModel) -> Prompt:
    """What ``sample`` asks the engine to decode."""
    return Prompt(
        sample.input_ids, sample.max_new_tokens, stop_ids(sample, loaded), sample.min_new_tokens, sample.question_start
    )


def context_rows(engines: list[Engine], samples: list[Sample], loaded: LoadedModel, batch_size: int) -> list[Row]:
    """The prefilled rows of ``samples`` (one :func:`context_groups` group) for each of ``engines`` (one model and
    regime), sample by sample: each sample prefilled once for all the engines
    (:func:`~kvbench.engine.shared.prefill_shared`), or the questions of one context answered from one compression of
    it per engine (:func:`~kvbench.engine.shared.prefill_questions`), or the draws of one prompt from one prefill of
    it per engine (:func:`~kvbench.engine.shared.prefill_draws`)."""
    if len(samples) == 1 and len(engines) == 1:
        return [sample_row(engines[0], samples[0], loaded)]
    prompts = [sample_prompt(sample, loaded) for sample in samples]
    if len(samples) == 1:
        return seed_rows(prefill_shared(engines, prompts[0], batch_size), samples)
    if one_prompts_draws(samples):  # all at once
        return seed_rows(prefill_draws(engines, prompts[0], len(samples), batch_size), samples)
    return seed_rows(prefill_questions(engines, prompts, batch_size), samples)


def draw_parts(
    engines: list[Engine], samples: list[Sample], loaded: LoadedModel, batch_size: int
) -> list[tuple[range, Callable[[], list[Row]]]]:
    """The rows of a problem's draws (``samples``: a :func:`context_groups` group of draws) for ``engines``, in parts
    of as many draws as fit their rows in ``batch_size`` (one at least): each part's places in ``samples`` and what
    makes its rows, seeded, from one prefill per engine (:class:`~kvbench.engine.shared.Draws`), so the caches held
    are the parts made and the prefilled ones, not every draw's at once."""
    draws = Draws(engines, sample_prompt(samples[0], loaded), len(samples), batch_size)
    most = max(1, batch_size // len(engines))
    places = [range(begin, min(begin + most, len(samples))) for begin in range(0, len(samples), most)]
    return [(part, functools.partial(drawn_rows, draws, samples[part.start : part.stop])) for part in places]


def drawn_rows(draws: Draws, samples: list[Sample]) -> list[Row]:
    """The rows of the next of ``draws``, one per sample of ``samples``, seeded for it."""
    return seed_rows(draws.take(len(samples)), samples)


def in_sample_order(
    finished: Iterable[tuple[int, Any]], sample_of: list[int], samples: int, made: Callable[[], int] | None = None
) -> Iterator[tuple[int, list[tuple[int, Any]]]]:
    """Rows' outputs ``(row, output)``, finishing in any order, grouped by sample: ``(sample position, its rows'
    outputs)`` for each of ``samples`` positions in order, once all its rows (``sample_of[row]`` is a row's sample
    position; a sample without rows has none) have finished. Rows made as they are decoded: ``sample_of`` grows with
    them, and ``made()`` says how many positions have all their rows made (None: all of them)."""
    remaining: Counter[int] = Counter()
    counted = 0  # the rows of sample_of in remaining
    outputs: dict[int, list[tuple[int, Any]]] = {}
    position = 0
    for row, output in finished:
        remaining.update(sample_of[counted:])
        counted = len(sample_of)
        outputs.setdefault(sample_of[row], []).append((row, output))
        remaining[sample_of[row]] -= 1
        ready = samples if made is None else made()
        while position < ready and remaining[position] == 0:
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
