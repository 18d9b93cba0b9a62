"""KeyDiff (``keydiff``) keeps, at every eviction, the keys least similar to the mean key direction of the cache it
evicts from, against a brute-force selection, in every regime and both GQA layouts."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import engine, random_prompt, tiny_model

BUDGET = 24


@pytest.mark.parametrize("gqa", ["sum", "repeat"])
@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_keydiff_keeps_the_keys_least_like_the_anchor(regime, gqa):
    """Before each eviction the expected kept set is computed in float64 from the layer's keys: the anchor is the mean
    of the normalised keys, each key scored by its cosine to it, the ``budget`` lowest kept."""
    evictions = []

    @contextmanager
    def checked(layer_idx, budget, scores, layer):  # EvictionCache.watch
        keys = layer.keys.double()  # [1,Hc,T,D]
        similarity = F.cosine_similarity(keys, F.normalize(keys, dim=-1).mean(dim=2, keepdim=True), dim=-1)
        expected = layer.positions.gather(2, similarity.topk(budget, dim=-1, largest=False).indices)
        yield
        evictions.append(torch.equal(layer.positions, expected.sort(dim=-1).values))

    runner = engine(tiny_model(), "keydiff", BUDGET, regime, gqa=gqa)
    cache = runner.new_cache(60)
    cache.watch = checked
    runner.prefill(cache, random_prompt(60))
    for step in range(4):  # decoding: evicts in chunked and streaming (decode_evict)
        runner.step(cache, [7 + step], 60 + step, evict=runner.decode_evict)
    assert len(evictions) >= 3 and all(evictions)
    assert cache.eviction_layers[0].keys.shape[1] == (4 if gqa == "repeat" else 2)
