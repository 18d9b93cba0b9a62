"""Rows: (sample, variant) pairs decoded greedily together, each over its own cache at its own length, one forward of
the model a step (:class:`~kvbench.engine.batches.RowBatch`), and perplexity texts streamed by several variants in
lockstep; each row gives what its engine gives alone."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvbench.engine.batches import RowBatch
from kvbench.engine.cache import EvictionCache
from kvbench.engine.memory import free_memory
from kvbench.engine.runner import GenerationOutput, PerplexityOutput, Runner
from kvbench.engine.sampling import seeded
from kvbench.engine.sizes import CacheSizes
from kvbench.engine.store import RowStore

#: ``engine.batch_size=auto``: the rows' caches take at most this share of the free memory, and at most
#: ``AUTO_MAX_ROWS`` rows decode together (:func:`batch_rows`). A grouped sweep's next sample joins as its rows fit
#: (:func:`finished_rows`' groups made on demand); more rows a step would decode a single run's samples in larger
#: bursts (a kill loses more in flight, progress comes later), so ``auto`` stays at 32 (the leaderboard sets 256)
AUTO_MEMORY_SHARE = 0.5
AUTO_MAX_ROWS = 32


@dataclass
class Row:
    """One (sample, variant) to decode greedily: its engine (model, policy, budget, regime), prefilled cache and the
    prompt's last logits ``[V]``; up to ``max_new_tokens``, stopping at any of ``stop_token_ids`` once
    ``min_new_tokens`` are generated (:meth:`Engine.generate`)."""

    engine: Runner
    cache: EvictionCache
    logits: torch.Tensor  # [V]
    prompt_tokens: int
    max_new_tokens: int
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_shared_by: int = 1
    context_shared_by: int = 1  # questions or draws answered from one compression (prefill_questions, prefill_draws)
    scoring_seconds: float = 0.0  # of prefill_seconds, the context's reconstruction
    generated: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    #: the choice from ``logits`` where a step of several rows made it (:func:`chosen_tokens`)
    chosen: int | None = None
    #: the seed of the row's draws where its engine samples (:class:`~kvbench.engine.sampling.Sampling`)
    seed: int = 0
    generator: torch.Generator | None = None
    #: the cache's bytes after each decode step, where it evicts while decoding (:attr:`GenerationOutput.kv_curve`)
    kv_curve: list[int] = field(default_factory=list)

    def next_token(self) -> int | None:
        """The row's choice from its logits, or None when the row is done (a stop token, or its last)."""
        if len(self.generated) >= self.max_new_tokens:
            return None
        token = chosen_tokens([self], self.logits[None])[0] if self.chosen is None else self.chosen
        self.chosen = None
        if token in self.stop_token_ids:
            return None
        self.generated.append(token)
        return None if len(self.generated) == self.max_new_tokens else token


def chosen_tokens(rows: Sequence[Row], logits: torch.Tensor) -> list[int]:
    """Each row's choice from its logits ``[N,V]``, a stop token never chosen before the row's ``min_new_tokens``:
    greedy (one argmax and one read back for all rows), or drawn where the row's engine samples
    (:class:`~kvbench.engine.sampling.Sampling`, from the row's own generator)."""
    banned = [
        (place, token)
        for place, row in enumerate(rows)
        if len(row.generated) < row.min_new_tokens
        for token in sorted(set(row.stop_token_ids))
    ]
    if banned:
        where = torch.tensor(banned, device=logits.device).T  # [2,K]: (row, token) pairs
        logits = logits.index_put((where[0], where[1]), logits.new_tensor(float("-inf")))
    chosen = logits.argmax(dim=-1).tolist()
    for place, row in enumerate(rows):
        if row.engine.sampling is not None:
            if row.generator is None:
                row.generator = seeded(row.seed)
            chosen[place] = row.engine.sampling.draw(logits[place], row.generator)
    return chosen


@torch.inference_mode()
def decode_rows(rows: list[Row], batch_size: int, store: RowStore | None = None) -> list[GenerationOutput]:
    """:func:`finished_rows`' outputs in the order of ``rows``; one row at a time gives :meth:`Engine.generate`'s."""
    finished = finished_rows(rows, batch_size, store=store)
    return [output for _, output in sorted(finished, key=lambda pair: pair[0])]


#: rows made on demand (:func:`finished_rows`): how many a group has, and what makes them (a prefill)
RowGroup = tuple[int, Callable[[], list[Row]]]


@torch.inference_mode()
def finished_rows(
    rows: list[Row], batch_size: int, more: Iterable[RowGroup] = (), store: RowStore | None = None
) -> Iterator[tuple[int, GenerationOutput]]:
    """Greedy decoding of ``rows`` (one model), up to ``batch_size`` at a time: every step feeds each active row's
    token at its own position through one forward of the model over a :class:`RowBatch`, where each row's cache
    attends, scores and evicts as alone (its engine's ``decode_evict``); a finished row leaves the batch, is yielded
    as ``(its index in rows, its output)``, and the next waiting row takes its place. ``more``: groups of rows made
    (numbered after ``rows``) one by one, in order, as soon as they fit beside the rows made and not finished (or when
    none are left), so a group's rows join the batch while the rows before them finish. Each row is charged its share
    of the steps it was in. A finished row is let go (its cache freed once the caller drops it): the rows held are
    at most the batch and the rows waiting, however many were decoded. Runs under inference mode at each step (a
    generator's caller may not be). ``store``: where the rows that only append and attend are held together (else
    one is made with the first step of an engine that stores them, ``engine.rows_attention=stored``)."""
    held: dict[int, Row] = {}  # the rows made and not finished, by index
    after_prefill: dict[int, CacheSizes] = {}
    kept: dict[int, list[list[list[int]]] | None] = {}
    waiting, active = deque[int](), list[int]()
    groups = iter(more)
    upcoming = next(groups, None)
    count = 0  # the rows made

    def wait(made: list[Row]) -> None:  # the rows made wait, their state after their prefill kept
        nonlocal count
        for row in made:
            held[count] = row
            row.cache.end_prefill()
            after_prefill[count] = row.cache.sizes_now()
            kept[count] = row.cache.kept_by_head() if row.engine.record_kept else None
            waiting.append(count)
            count += 1

    def output(index: int) -> tuple[int, GenerationOutput]:
        row = held.pop(index)  # (a stored row has left the store: RowStore.leave)
        kv = row.engine.cache_sizes(row.cache, after_prefill.pop(index), row.prompt_tokens + len(row.generated))
        stats = row.cache.policy_stats()
        finished = GenerationOutput(
            row.generated, row.prompt_tokens, row.prefill_seconds, row.decode_seconds, kv, stats, kept.pop(index)
        )
        finished.prefill_shared_by, finished.context_shared_by = row.prefill_shared_by, row.context_shared_by
        finished.scoring_seconds = row.scoring_seconds
        finished.kv_curve = row.kv_curve
        return index, finished

    wait(rows)
    while True:
        while upcoming is not None and (
            not (waiting or active) or len(waiting) + len(active) + upcoming[0] <= batch_size
        ):
            wait(upcoming[1]())
            upcoming = next(groups, None)
        if not (waiting or active):
            return
        lead = held[(active or waiting)[0]].engine
        if store is None and lead.rows_attention == "stored":
            store = RowStore()
        start = lead.now()
        stepping: list[tuple[int, int]] = []  # (row index, its next token)
        done: list[int] = []
        for index in active:
            if (token := held[index].next_token()) is None:
                done.append(index)
            else:
                stepping.append((index, token))
        while waiting and len(stepping) < batch_size:  # waiting rows take the places of finished ones
            index = waiting.popleft()
            if (token := held[index].next_token()) is None:
                done.append(index)
            else:
                stepping.append((index, token))
        if store is not None:  # a shelf steps all its rows (an attending modifier's state with them)
            store.leave([held[index].cache for index in done])
        finished = [output(index) for index in done]  # made before the step, which may place rows where they were
        if stepping:
            logits = step_rows([(held[index], token) for index, token in stepping], store)  # [N,V]
            chosen = chosen_tokens([held[index] for index, _ in stepping], logits)
            for place, (index, _) in enumerate(stepping):
                held[index].logits, held[index].chosen = logits[place], chosen[place]
        active = [index for index, _ in stepping]
        for index in active:  # an evicting cache's size over the generation, as the cache accounts it
            if (row := held[index]).engine.decode_evict:
                position = row.prompt_tokens + len(row.generated) - 1
                held_bytes = sum(row.cache.live_bytes) if store is None else store.held_bytes(row.cache, position)
                row.kv_curve.append(held_bytes)
        share = (lead.now() - start) / max(len(stepping), 1)
        for index in active:
            held[index].decode_seconds += share
        yield from finished


def step_rows(stepping: list[tuple[Row, int]], store: RowStore | None = None) -> torch.Tensor:
    """One forward of each row's next token at its position (the prompt's length plus what it generated before),
    evicting as its engine decodes (``store``: where the rows that only append and attend are held together);
    returns the logits ``[N,V]``."""
    rows = [row for row, _ in stepping]
    positions = [row.prompt_tokens + len(row.generated) - 1 for row in rows]
    # a row's engine evicts while decoding, every decode_interval-th token, where its policy evicts (not full's)
    intervals = [
        row.engine.decode_interval if row.engine.decode_evict and row.cache.policy.evicts else 0 for row in rows
    ]
    evicts = [every > 0 and len(row.generated) % every == 0 for every, row in zip(intervals, rows)]
    caches, tokens = [row.cache for row in rows], [[token] for _, token in stepping]
    alone = None
    if store is not None:  # the tokens each may append stored: up to its next eviction where it evicts decoding
        to_come = [row.max_new_tokens - len(row.generated) + 1 for row in rows]
        to_come = [
            min(more, every - len(row.generated) % every) if every else more
            for more, every, row in zip(to_come, intervals, rows)
        ]
        alone = store.begin_step(caches, positions, to_come, evicts)
    logits = forward_rows(rows[0].engine, caches, tokens, positions, evicts, store=store, alone=alone)
    return logits[:, -1]


def forward_rows(
    lead: Runner,
    caches: list[EvictionCache],
    token_ids: list[list[int]],
    starts: list[int],
    evicts: list[bool],
    all_logits: bool = False,
    store: RowStore | None = None,
    alone: list[int] | None = None,
) -> torch.Tensor:
    """One forward of ``lead``'s model over rows of as many tokens each, row ``r``'s ``token_ids[r]`` at positions
    ``starts[r]..`` into ``caches[r]``, which evicts after it if ``evicts[r]``: through a :class:`RowBatch`, each
    cache as :meth:`Runner.step` feeds it alone (but the rows of ``store`` outside ``alone``, which a step declared
    to it). Returns the logits ``[N,q|1,V]``."""
    length = len(token_ids[0])
    positions = torch.tensor([[start + offset for offset in range(length)] for start in starts], device=lead.device)
    for place in range(len(caches)) if alone is None else alone:
        caches[place].begin_forward(
            positions[place], evict=evicts[place], decoding=starts[place] >= caches[place].prompt_len
        )
    padded, span = lead.rows_attention == "padded", max(starts) + length
    rows = RowBatch(caches, padded=padded, store=store, alone=alone, span=span)
    return lead.forward(rows, torch.tensor(token_ids, device=lead.device), positions, all_logits)


def prefill_rows(engines: Sequence[Runner], caches: list[EvictionCache], input_ids: list[int]) -> torch.Tensor:
    """:meth:`Runner.prefill` of one prompt into each of ``caches``, the engines of one regime and block size feeding
    each block to every row in one forward (each cache evicting after it as alone); the last logits ``[N,1,V]``."""
    block = engines[0].block_size or len(input_ids)
    count = len(caches)
    for begin in range(0, len(input_ids), block):
        ids = input_ids[begin : begin + block]
        logits = forward_rows(engines[0], caches, [ids] * count, [begin] * count, [True] * count)
    return logits


def lockstep_groups(engines: Sequence[Runner], indices: Sequence[int], batch_size: int) -> list[list[int]]:
    """``indices`` of ``engines`` in groups that can feed one text in lockstep: one regime and block size, at most
    ``batch_size`` rows."""
    by_block: dict[tuple[str, int | None], list[int]] = {}
    for index in indices:
        by_block.setdefault((engines[index].regime, engines[index].block_size), []).append(index)
    return [
        group[begin : begin + batch_size] for group in by_block.values() for begin in range(0, len(group), batch_size)
    ]


@torch.inference_mode()
def perplexity_rows(
    engines: Sequence[Runner], input_ids: list[int], context_tokens: int = 0, batch_size: int = 1
) -> list[PerplexityOutput]:
    """:meth:`Engine.perplexity` of each engine on one text, up to ``batch_size`` engines of one regime and block
    size feeding it together (:func:`forward_rows`: each block one forward for all their rows). Outputs in the order
    of ``engines``, each reporting its share of the forwards."""
    outputs: list[PerplexityOutput | None] = [None] * len(engines)
    for group in lockstep_groups(engines, range(len(engines)), batch_size):
        for index, output in zip(group, _perplexity_together([engines[i] for i in group], input_ids, context_tokens)):
            outputs[index] = output
    return [output for output in outputs if output is not None]


def _perplexity_together(
    engines: Sequence[Runner], input_ids: list[int], context_tokens: int
) -> list[PerplexityOutput]:
    """:func:`perplexity_rows` of engines of one regime and block size, all together."""
    lead, count = engines[0], len(engines)
    caches = [engine.new_cache(max(context_tokens, 1) if context_tokens else len(input_ids)) for engine in engines]
    context_tokens = max(context_tokens, 1)
    start = lead.now()
    logits = prefill_rows(engines, caches, input_ids[:context_tokens])
    prefill_seconds = (lead.now() - start) / count
    for cache in caches:
        cache.end_prefill()
    after_prefill = [cache.sizes_now() for cache in caches]
    start = lead.now()
    nlls: list[list[torch.Tensor]] = [[] for _ in engines]
    step = lead.block_size if lead.regime == "chunked" else 1
    assert step is not None  # the chunked regime always has a block size
    targets = torch.tensor(input_ids, device=lead.device)
    evicts = [engine.decode_evict for engine in engines]
    for begin in range(context_tokens, len(input_ids), step):
        block = input_ids[begin : begin + step]
        for row in range(count):
            nlls[row].append(Runner.nll(logits[row, -1:], targets[begin : begin + 1]))
        if len(block) == 1 and begin == len(input_ids) - 1:
            break
        logits = forward_rows(lead, caches, [block] * count, [begin] * count, evicts, all_logits=len(block) > 1)
        for row in range(count):
            nlls[row].append(Runner.nll(logits[row, :-1], targets[begin + 1 : begin + len(block)]))
    decode_seconds = (lead.now() - start) / count
    outputs = []
    for engine, cache, sizes, values in zip(engines, caches, after_prefill, nlls):
        kv = engine.cache_sizes(cache, sizes, len(input_ids))
        nll = torch.cat(values).tolist() if values else []
        outputs.append(PerplexityOutput(nll, prefill_seconds, decode_seconds, kv, cache.policy_stats()))
    return outputs


def batch_rows(setting: int | str, engines: Sequence[Runner], prompt_tokens: int, new_tokens: int) -> int:
    """``engine.batch_size``: how many rows decode together — the number given, or for ``auto`` as many of the heaviest
    engine's rows of a ``prompt_tokens`` prompt generating ``new_tokens`` (:meth:`Runner.row_bytes`) as
    ``AUTO_MEMORY_SHARE`` of the free memory holds, at least 1 and at most ``AUTO_MAX_ROWS``."""
    if setting != "auto":
        return int(setting)
    heaviest = max(engine.row_bytes(prompt_tokens, new_tokens) for engine in engines)
    fits = int(AUTO_MEMORY_SHARE * free_memory(engines[0].device)) // heaviest
    return max(1, min(AUTO_MAX_ROWS, fits))
