"""CriticalKV (``+criticalkv``) and ChunkKV (``+chunkkv``) over KNorm's score, against brute-force selections computed
from each eviction's cache in float64, in every regime and both GQA layouts (a prompt of distinct tokens: in layer 0
copies of one token tie)."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.engine.cache import EvictionCache
from tests.helpers import checked_evictions, engine, prefill_and_decode, tiny_model

BUDGET, CHUNK = 24, 5


def matching(expected_kept):
    """A verdict (:func:`tests.helpers.checked_evictions`): the kept slots are ``expected_kept(layer_idx, keys, values,
    budget)``, a mask ``[Hc,T]``."""

    def verdict(layer_idx, keys, values, kept, budget):
        return torch.equal(kept, expected_kept(layer_idx, keys, values, budget))

    return verdict


def run(model, spec: str, regime: str, gqa: str, watch, **settings) -> EvictionCache:
    runner = engine(model, spec, BUDGET, regime, gqa=gqa, norm_bits=None, **settings)
    distinct = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:60].tolist()  # no repeated token
    return prefill_and_decode(runner, distinct, watch=watch)


@pytest.mark.parametrize("gqa", ["sum", "repeat"])
@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_criticalkv_keeps_the_bases_first_half_then_the_projected_scores(regime, gqa):
    """The first ``BUDGET/2`` by −‖k‖ (KNorm), then the rest by ``(−‖k‖ + ε)·mean_h ‖v·W_O[h]‖₁`` over the query heads
    reading the cache head, each head's projection a separate matmul."""
    model = tiny_model()
    layers = model.model.layers

    def expected(layer_idx, keys, values, budget):
        output = layers[layer_idx].self_attn.o_proj.weight.double().T  # [Hq·D, hidden]
        q_heads, dim = 4, keys.shape[-1]
        heads = keys.shape[0]
        kept = torch.zeros(keys.shape[:2], dtype=torch.bool)
        for head in range(heads):
            readers = range(head * q_heads // heads, (head + 1) * q_heads // heads)
            norm = sum((values[head] @ output[r * dim : (r + 1) * dim]).abs().sum(-1) for r in readers) / len(readers)
            score = -keys[head].norm(dim=-1)
            first = score.topk(budget // 2).indices
            second = ((score + 1e-4) * norm).index_fill(0, first, -math.inf).topk(budget - budget // 2).indices
            kept[head, first], kept[head, second] = True, True
        return kept

    watch, evictions = checked_evictions(matching(expected))
    run(model, "knorm+criticalkv", regime, gqa, watch)
    assert len(evictions) >= 3 and all(evictions)


@pytest.mark.parametrize("gqa", ["sum", "repeat"])
@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_chunkkv_keeps_whole_chunks_by_their_mean_score(regime, gqa):
    """Chunks of ``CHUNK`` slots (the last shorter) ranked by the mean over their slots of −‖k‖ summed over the cache
    heads; the best ``max(1, int(chunks · budget / slots))`` kept whole (kvpress's count: fewer slots than the budget
    where it is not whole chunks, or more where the last chunk is short); one set per layer."""

    def expected(layer_idx, keys, values, budget):
        score = -keys.norm(dim=-1).sum(dim=0)  # [T]
        tokens = score.shape[0]
        chunks = list(torch.arange(tokens).split(CHUNK))
        order = sorted(chunks, key=lambda chunk: float(score[chunk].mean()), reverse=True)
        count = max(1, int(len(chunks) * budget / tokens))
        mask = torch.zeros(tokens, dtype=torch.bool)
        for chunk in order[:count]:
            mask[chunk] = True
        return mask.expand(keys.shape[0], -1)

    watch, evictions = checked_evictions(matching(expected))
    run(tiny_model(), "knorm+chunkkv", regime, gqa, watch, chunk_length=CHUNK)
    assert len(evictions) >= 3 and all(evictions)


def test_the_chunk_variants_of_a_shared_prefill_count_what_they_keep_together():
    """ChunkKV keeps its reserved slots and whole chunks, as many slots as its ranking leaves finite (a short last
    chunk keeps fewer): in one shared forward of ChunkKV over three bases at two budgets and chunk lengths (one not
    dividing the slots), each variant keeps what it keeps prefilled alone, those counts read back once a layer."""
    from kvbench.bench.measure import Operators
    from kvbench.engine.shared import Prompt, prefill_shared
    from tests.helpers import random_prompt

    model, prompt = tiny_model(), random_prompt(101)
    bases = ("snapkv", "tova", "knorm")
    engines = [
        engine(model, f"{base}+chunkkv", budget, chunk_length=length)
        for base in bases
        for budget in (40, 56)
        for length in (5, 7)
    ]
    alone = []
    for each in engines:
        cache = each.new_cache(len(prompt))
        each.prefill(cache, prompt)
        alone.append(cache.kept_by_head())
    with Operators() as counted:
        rows = prefill_shared(engines, Prompt(prompt, 1), batch_size=len(engines))
    assert [row.cache.kept_by_head() for row in rows] == alone
    assert counted.host_reads == 0  # the counts read back by one .tolist() a layer (which a CPU does not count)
