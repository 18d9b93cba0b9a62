"""Modifiers inside the cache rank tokens exactly as the pure scores computed directly on full attention."""

from __future__ import annotations

import pytest
import torch

from kvbench.policies import build_policy
from kvbench.policies.scores import caote, fast_caote, obcache
from tests.test_policies import KV_HEADS, Q_HEADS, SCALING, TOKENS, evict_with_cache, random_layer


def full_attention(queries, keys, values, query_indices):
    """Causal attention of the chosen queries over all tokens, per query head, float64."""
    group = Q_HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    q = queries.double()[:, :, query_indices]
    logits = torch.einsum("bhwd,bhtd->bhwt", q, k) * SCALING
    future = torch.arange(TOKENS)[None, :] > torch.tensor(query_indices)[:, None]
    logits = logits.masked_fill(future, float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    return logits, weights, weights @ v, v


def group_sum(scores):
    return scores.view(1, KV_HEADS, Q_HEADS // KV_HEADS, -1).sum(dim=2)


def kept_by_scores(scores, budget, reserved=()):
    """Top-``budget`` positions per KV head with ``reserved`` positions forced in."""
    scores = scores.clone()
    scores[..., list(reserved)] = float("inf")
    return [set(scores[0, head].topk(budget).indices.tolist()) for head in range(KV_HEADS)]


@pytest.mark.parametrize("kind", ["value", "key", "joint"])
def test_h2o_obcache_accumulates_obcache_scores_over_all_queries(kind):
    budget, recent, seed = 16, 4, 7
    kept = evict_with_cache(f"h2o+obcache_{kind}", {"window": recent}, budget, seed)
    queries, keys, values = random_layer(seed)
    logits, weights, outputs, v = full_attention(queries, keys, values, list(range(TOKENS)))
    scores = group_sum(getattr(obcache(weights, logits, outputs, v), kind))
    assert kept == kept_by_scores(scores, budget, reserved=range(TOKENS - recent, TOKENS))


@pytest.mark.parametrize("kind", ["value", "key", "joint"])
def test_tova_obcache_uses_the_last_query(kind):
    budget, seed = 12, 8
    kept = evict_with_cache(f"tova+obcache_{kind}", {"heads": "head"}, budget, seed)
    queries, keys, values = random_layer(seed)
    logits, weights, outputs, v = full_attention(queries, keys, values, [TOKENS - 1])
    assert kept == kept_by_scores(group_sum(getattr(obcache(weights, logits, outputs, v), kind)), budget)


@pytest.mark.parametrize("spec,score,power", [("tova+caote", caote, 1.0), ("tova+fastcaote", fast_caote, 1.0)])
def test_tova_caote_ranks_by_eviction_error_of_last_query(spec, score, power):
    budget, seed = 12, 9
    kept = evict_with_cache(spec, {"heads": "head"}, budget, seed)
    queries, keys, values = random_layer(seed)
    _, weights, _, _ = full_attention(queries, keys, values, [TOKENS - 1])
    alpha = group_sum(weights[:, :, 0])
    assert kept == kept_by_scores(score(alpha, values.double(), power), budget)


def test_tova_layer_mode_averages_the_modified_scores_over_heads():
    """TOVA's layer mode (its released code): the per-head CAOTE scores averaged over the layer's heads
    pick one token set, kept in every head."""
    budget, seed = 12, 9
    kept = evict_with_cache("tova+caote", {}, budget, seed)
    queries, keys, values = random_layer(seed)
    _, weights, _, _ = full_attention(queries, keys, values, [TOKENS - 1])
    per_head = caote(group_sum(weights[:, :, 0]), values.double(), 1.0)  # [1,Hkv,T]
    layer = per_head.mean(dim=1, keepdim=True).expand_as(per_head)
    assert kept == kept_by_scores(layer, budget) and kept[0] == kept[1]


@pytest.mark.parametrize("settings,power", [({}, 1.0), ({"power": 2.0}, 2.0)])
def test_h2o_caote_ranks_the_normalised_accumulated_score(settings, power):
    """CAOTE over H2O: eq. 6 on the accumulated score normalised to the simplex (default, unsquared), or
    eq. 7 as printed (``power=2``)."""
    budget, recent, seed = 16, 4, 10
    policy = build_policy("h2o+caote", {"window": recent, **settings})
    assert policy.modifiers[0].power == power
    kept = evict_with_cache("h2o+caote", {"window": recent, **settings}, budget, seed)
    queries, keys, values = random_layer(seed)
    _, weights, _, _ = full_attention(queries, keys, values, list(range(TOKENS)))
    accumulated = group_sum(weights.sum(dim=2))
    expected = kept_by_scores(
        caote(accumulated, values.double(), power), budget, reserved=range(TOKENS - recent, TOKENS)
    )
    assert kept == expected


def test_caote_power_is_a_parameter():
    assert build_policy("snapkv+caote", {"power": 2.0}).modifiers[0].power == 2.0
    for spec in ("tova+caote", "h2o+caote", "snapkv+caote", "h2o+fastcaote"):
        assert build_policy(spec).modifiers[0].power == 1.0
