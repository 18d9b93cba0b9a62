"""The ``contexts`` section of ``kvbench bench``: what compressing a shared context once saves (``task.query_mode=
agnostic`` with ``task.questions_per_context``).

RULER samples are generated with ``questions`` questions about each of ``contexts`` haystacks and answered by every
``policies`` × ``budgets`` variant twice, context by context: each context compressed once per variant and every
question read into a copy of its compressed cache (:func:`~kvbench.engine.shared.prefill_questions`, what
``kvbench run`` does), and each question's context compressed again for it (one
:func:`~kvbench.engine.shared.prefill_shared` per question); both decode their rows together, ``batch_size`` at a
time. The two orders alternate between contexts; the predictions are compared row by row.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kvbench.bench.grid import job_overrides
from kvbench.config import compose
from kvbench.engine.rows import Row, batch_rows, decode_rows
from kvbench.run import build_task, context_groups, context_rows

if TYPE_CHECKING:
    from kvbench.bench.sections import Bench
    from kvbench.tasks.base import Sample


def shared_contexts(bench: Bench) -> dict[str, Any]:
    """The contexts section's fields of ``bench.json``: ``contexts`` (seconds and compressions each way, the speed-up,
    the predictions' agreement) and its raw seconds per context."""
    section = bench.bench.contexts
    count, questions = int(section.contexts), int(section.questions)
    overrides = [
        *job_overrides(bench.cfg, section),
        f"task.num_samples={count * questions}",
        f"task.questions_per_context={questions}",
        f"task.tokens_to_generate={section.new_tokens}",
        "task.query_mode=agnostic",
    ]
    job = compose(overrides)
    task = build_task(job, bench.loaded.tokenizer)
    groups = context_groups(list(task.samples()))
    engines = [bench.engine(str(spec), budget=str(budget)) for spec in section.policies for budget in section.budgets]
    longest = max(len(sample.input_ids) for group in groups for sample in group)
    batch = batch_rows(job.engine.batch_size, engines, longest, int(section.new_tokens))  # as kvbench run decodes
    seconds: dict[str, list[float]] = {"once_per_context": [], "once_per_question": []}
    compressions = {kind: 0.0 for kind in seconds}
    tokens: dict[str, list[list[int]]] = {kind: [] for kind in seconds}
    for number, group in enumerate(groups):
        kinds = list(seconds) if number % 2 == 0 else list(reversed(seconds))
        for kind in kinds:
            answer = functools.partial(answer_context, bench, engines, group, batch, kind == "once_per_context")
            wall, _, (rows, outputs) = bench.clock.measure(answer)
            seconds[kind].append(wall)
            compressions[kind] += sum(1 / row.context_shared_by for row in rows)
            tokens[kind] += [output.token_ids for output in outputs]
    once, again = sum(seconds["once_per_context"]), sum(seconds["once_per_question"])
    result = {
        "contexts": len(groups),
        "questions": sum(len(group) for group in groups),
        "variants": len(engines),
        "compressions": compressions,
        "once_per_context_seconds": once,
        "once_per_question_seconds": again,
        "speed_ratio": again / once,
        "predictions_equal": tokens["once_per_context"] == tokens["once_per_question"],
    }
    return {"contexts": result, "raw": {"contexts": {"seconds": seconds}}}


def answer_context(
    bench: Bench, engines: list, group: list[Sample], batch: int, once: bool
) -> tuple[list[Row], list[Any]]:
    """Every question of one context answered by every engine: the context compressed ``once`` for its questions, or
    once per question; the prefilled rows (question by question) and their outputs."""
    loaded = bench.loaded
    if once:
        rows = context_rows(engines, group, loaded, batch)
    else:
        rows = [row for sample in group for row in context_rows(engines, [sample], loaded, batch)]
    return rows, decode_rows(rows, batch)
