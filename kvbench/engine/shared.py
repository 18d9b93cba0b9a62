"""Shared prefills and questions: one prompt prefilled for several variants by one forward per head layout
(:class:`~kvbench.engine.batches.SharedPrefill`), and the questions of one context each read into a copy of the
context's compressed cache, as rows for :func:`~kvbench.engine.rows.decode_rows`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from kvbench.engine.batches import SharedPrefill
from kvbench.engine.rows import Row, decode_rows, forward_rows, lockstep_groups, prefill_rows
from kvbench.engine.runner import GenerationOutput, Runner
from kvbench.policies.base import Policy


def repeats_kv(policy: Policy) -> bool:
    """Whether ``policy`` holds its cache per query head (``gqa=repeat``): the variants one :class:`SharedPrefill`
    forward fills share their head layout (a policy reads the backend's attention, so any policies share one)."""
    return policy.gqa == "repeat"


@torch.inference_mode()
def generate_shared(
    engines: Sequence[Runner],
    input_ids: list[int],
    max_new_tokens: int,
    stop_token_ids=(),
    min_new_tokens: int = 0,
    batch_size: int = 1,
    question_start: int | None = None,
) -> list[GenerationOutput]:
    """:meth:`Engine.generate` of each engine (its own policy and budget; one model, one regime) on one prompt,
    the variants that :meth:`Runner.shares_prefill` prefilled by one forward (:class:`SharedPrefill`) per head
    layout (:func:`repeats_kv`), whatever their policies and budgets, the others (chunked,
    streaming) feeding the prompt's blocks as rows; then the variants decode as rows, ``batch_size`` at a time
    (:func:`decode_rows`). Each output reports the shared prefill's time divided among the variants that shared it.
    Outputs equal :meth:`Engine.generate`'s."""
    prompt = Prompt(input_ids, max_new_tokens, stop_token_ids, min_new_tokens, question_start)
    rows = prefill_shared(engines, prompt, batch_size)
    return decode_rows(rows, batch_size)


@torch.inference_mode()
def prefill_shared(engines: Sequence[Runner], prompt: Prompt, batch_size: int = 1) -> list[Row]:
    """The prefilled rows of :func:`generate_shared`, one per engine, ready for :func:`decode_rows`; the variants
    that do not share a forward (chunked, streaming) feed the prompt's blocks as rows, ``batch_size`` at a time.
    With a ``question_start``, what is prefilled is the prompt's context, and then every row reads the question
    without evicting (:func:`prefill_questions` of one question)."""
    if prompt.question_start is not None:
        return prefill_questions(engines, [prompt], batch_size)
    rows = compressed_rows(engines, prompt.input_ids, batch_size, context=False)
    for row in rows:
        row.max_new_tokens, row.stop_token_ids = prompt.max_new_tokens, prompt.stop_token_ids
        row.min_new_tokens = prompt.min_new_tokens
    return rows


@dataclass(frozen=True)
class Prompt:
    """A prompt decoded as :meth:`Engine.generate` decodes; with ``question_start``, answered from a compressed
    context: ``input_ids[:question_start]`` the context, the rest the question."""

    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0
    question_start: int | None = None

    @property
    def context(self) -> list[int]:
        return self.input_ids[: self.question_start]


@torch.inference_mode()
def prefill_questions(engines: Sequence[Runner], questions: Sequence[Prompt], batch_size: int = 1) -> list[Row]:
    """Rows of every (question, engine), question by question: the context the ``questions`` share compressed once
    per engine (:func:`compressed_rows`), then each question read into its own copy of each engine's compressed cache
    (:func:`read_question`), so each answers from the context as if it were the only one; the compression's time is
    divided among the questions (``Row.context_shared_by``)."""
    context = questions[0].context
    if any(question.context != context for question in questions):
        raise ValueError("questions answered from one compressed context must share its tokens")
    compressed = compressed_rows(engines, context, batch_size)
    rows: list[Row] = []
    for question, asked in zip(questions, shared_copies(compressed, len(questions))):
        for row in asked:
            row.prompt_tokens, row.max_new_tokens = len(question.input_ids), question.max_new_tokens
            row.stop_token_ids, row.min_new_tokens = question.stop_token_ids, question.min_new_tokens
        read_question(asked, question.input_ids, cast(int, question.question_start), batch_size)
        rows += asked
    return rows


def prefill_draws(engines: Sequence[Runner], prompt: Prompt, draws: int, batch_size: int = 1) -> list[Row]:
    """Rows of every (draw, engine), draw by draw: ``prompt`` prefilled once per engine, each draw given its own copy
    of each engine's cache (:class:`Draws`, all at once)."""
    return Draws(engines, prompt, draws, batch_size).take(draws)


class Draws:
    """The rows of ``draws`` draws of one prompt, made as they are asked for: the prompt prefilled once per engine at
    the first ask (:func:`prefill_shared`: the prefill does not depend on what is drawn after it), each ask's draws
    given copies of its caches, the last ask the originals; the prefill's time divided among the draws
    (``Row.context_shared_by``). The caches held are those of the draws asked for, and the prefilled ones until the
    last ask."""

    def __init__(self, engines: Sequence[Runner], prompt: Prompt, draws: int, batch_size: int = 1):
        self.engines, self.prompt, self.draws, self.batch_size = engines, prompt, draws, batch_size
        self.prefilled: list[Row] | None = None
        self.left = draws  # the draws not asked for

    @torch.inference_mode()
    def take(self, count: int) -> list[Row]:
        """The rows of the next ``count`` draws, draw by draw (an engine's row each)."""
        if not 0 < count <= self.left:
            raise ValueError(f"{count} draws asked for, {self.left} left")
        if self.prefilled is None:
            self.prefilled = prefill_shared(self.engines, self.prompt, self.batch_size)
        self.left -= count
        rows = [row for copies in shared_copies(self.prefilled, count, self.draws, self.left == 0) for row in copies]
        if not self.left:
            self.prefilled = None  # the originals are the last draw's
        return rows


def shared_copies(rows: list[Row], count: int, shared_by: int | None = None, last: bool = True) -> list[list[Row]]:
    """``rows`` (prefilled, nothing decoded) ``count`` times, each time rows of their own: a copy of each cache (with
    ``last``, the originals the last time), the prefill's time divided among ``shared_by`` (``count``) rows
    (``Row.context_shared_by``)."""
    shared_by = shared_by or count
    return [
        [
            replace(
                row,
                cache=row.cache if last and number == count - 1 else copy.deepcopy(row.cache),
                prefill_seconds=row.prefill_seconds / shared_by,
                scoring_seconds=row.scoring_seconds / shared_by,
                context_shared_by=shared_by,
                generated=[],
                kv_curve=[],
            )
            for row in rows
        ]
        for number in range(count)
    ]


def compressed_rows(engines: Sequence[Runner], prompt: list[int], batch_size: int, context: bool = True) -> list[Row]:
    """Each engine's ``prompt`` (``context``: a context, as :meth:`Runner.new_cache`) prefilled and evicted under its
    regime into a new cache, as a row (its decoding settings left to the caller): the variants that
    :meth:`Runner.shares_prefill` by one forward per head layout, the others feeding the prompt's blocks as rows,
    ``batch_size`` at a time; then the contexts that a reconstruction scores (:func:`reconstruct`)."""
    rows = [Row(engine, engine.new_cache(len(prompt), context), torch.empty(0), len(prompt), 0) for engine in engines]
    sharing: dict[bool, list[Row]] = {}  # by head layout (repeats_kv): the variants of one forward
    alone = []  # the variants that feed their prompt in blocks (chunked, streaming): in lockstep, as rows
    for index, row in enumerate(rows):
        if row.engine.shares_prefill(row.cache):
            sharing.setdefault(repeats_kv(row.cache.policy), []).append(row)
        else:
            alone.append(index)
    for indices in lockstep_groups(engines, alone, batch_size):
        lockstep = [rows[index] for index in indices]
        start = engines[indices[0]].now()
        logits = prefill_rows([row.engine for row in lockstep], [row.cache for row in lockstep], prompt)
        seconds = (engines[indices[0]].now() - start) / len(lockstep)
        for row, last in zip(lockstep, logits):
            row.logits, row.prefill_seconds = last[-1], seconds
    for group in sharing.values():
        lead = group[0].engine
        start = lead.now()
        shared = lead.prefill(SharedPrefill([row.cache for row in group]), prompt)[0, -1]
        seconds = (lead.now() - start) / len(group)
        for row in group:
            row.logits, row.prefill_seconds, row.prefill_shared_by = shared, seconds, len(group)
            row.scoring_seconds = row.cache.scoring_seconds
    return rows


def read_question(rows: list[Row], input_ids: list[int], question_start: int, batch_size: int) -> None:
    """Query-agnostic: each row reads its prompt's question ``input_ids[question_start:]`` into the cache its context
    was compressed into, at the question's own positions and without evicting, ``batch_size`` rows a forward; the
    question's last logits become the row's, its time is added to the row's prefill. An empty question reads nothing
    (the context's last logits stay the row's)."""
    question = input_ids[question_start:]
    if not question:
        return
    for begin in range(0, len(rows), batch_size):
        group = rows[begin : begin + batch_size]
        lead = group[0].engine
        start = lead.now()
        caches, count = [row.cache for row in group], len(group)
        logits = forward_rows(lead, caches, [question] * count, [question_start] * count, [False] * count)
        seconds = (lead.now() - start) / count
        for row, last in zip(group, logits):
            row.logits, row.prefill_seconds = last[-1], row.prefill_seconds + seconds
