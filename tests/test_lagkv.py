"""LagKV (``lagkv``) keeps, at every eviction, a top set of its lag-relative ranks computed by brute force (one
partition at a time, float64), in every regime and both GQA layouts; and random (``random``) keeps the top of its
seeded draw."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.cache import EvictionCache
from tests.helpers import checked_evictions, engine, prefill_and_decode, random_prompt, tiny_model

BUDGET, LAG, SINKS = 24, 8, 2


def lagkv_ranks(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """LagKV's score of one head's ``keys``/``values [T,D]`` partition by partition: the sinks and the last
    partition 1, every other slot its rank within its partition over ``LAG``."""
    tokens = keys.shape[0]
    scores = torch.ones(tokens, dtype=torch.float64)
    if tokens < SINKS + 2 * LAG:
        scores[SINKS:] = torch.arange(tokens - SINKS, dtype=torch.float64) / (tokens - SINKS)
        return scores
    starts = range(SINKS, SINKS + ((tokens - SINKS) // LAG - 1) * LAG, LAG)
    for start in starts:
        relative = torch.zeros(LAG, dtype=torch.float64)
        for states in (keys, values):
            part, reference = states[start : start + LAG], states[start + LAG : start + 2 * LAG]
            low, high = reference.min(dim=0).values, reference.max(dim=0).values
            relative += torch.softmax(((part - low) / (high - low)).std(dim=1), dim=0) / 2
        scores[start : start + LAG] = relative.argsort().argsort().double() / LAG
    return scores


def top_set_of(expected_scores):
    """A verdict (:func:`tests.helpers.checked_evictions`): each cache head kept ``budget`` slots, a top set of
    ``expected_scores(keys, values)`` (ties broken either way)."""

    def verdict(layer_idx, keys, values, kept, budget):
        scores = [expected_scores(keys[head], values[head]) for head in range(keys.shape[0])]
        tops = (bool(score[mask].min() >= score[~mask].max()) for mask, score in zip(kept, scores))
        return bool((kept.sum(-1) == budget).all()) and all(tops)

    return verdict


def run(spec: str, regime: str, gqa: str, watch=None, **settings) -> EvictionCache:
    return prefill_and_decode(
        engine(tiny_model(), spec, BUDGET, regime, gqa=gqa, **settings), random_prompt(60), watch=watch
    )


@pytest.mark.parametrize("gqa", ["sum", "repeat"])
@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_lagkv_keeps_its_top_ranks(regime, gqa):
    watch, evictions = checked_evictions(top_set_of(lagkv_ranks))
    cache = run("lagkv", regime, gqa, watch, lag_size=LAG, n_sink=SINKS)
    assert len(evictions) >= 3 and all(evictions)
    assert cache.eviction_layers[0].keys.shape[1] == (4 if gqa == "repeat" else 2)


def test_lagkv_without_a_reference_keeps_the_sinks_and_the_newest():
    """A cache shorter than the sinks and two partitions: LagKV keeps the sinks and then the newest slots."""
    cache = run("lagkv", "oneshot", "sum", lag_size=40, n_sink=SINKS)
    expected = torch.cat([torch.arange(SINKS), torch.arange(60 - BUDGET + SINKS, 64)])
    assert torch.equal(cache.eviction_layers[0].positions[0, 0], expected)


@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_random_keeps_the_top_of_its_seeded_draw(regime):
    """Each eviction keeps the top of ``torch.rand(Hc, T)`` from a generator seeded with ``seed``: the same draw
    on every layer (kvpress's ``RandomPress``), another with another seed."""

    def verdict(layer_idx, keys, values, kept, budget):
        expected = torch.rand(kept.shape, generator=torch.Generator().manual_seed(5))  # [Hc,T]
        return torch.equal(kept, torch.zeros_like(kept).scatter_(-1, expected.topk(budget, dim=-1).indices, True))

    watch, evictions = checked_evictions(verdict)
    run("random", regime, "sum", watch, seed=5)
    assert len(evictions) >= 3 and all(evictions)
