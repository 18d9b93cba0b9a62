"""KNorm (``knorm``) keeps the lowest-norm keys of each cache head, against a brute-force selection, in every
regime and both GQA layouts; and what a score may read (``ScoreContext``) is the layer's own cache and weights."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.layer import EvictionLayer
from kvbench.policies import build_policy
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext
from tests.helpers import engine, random_prompt, tiny_model

BUDGET = 24


def appended_keys(monkeypatch) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Record every layer's appended keys (in the cache's heads) and positions, by layer object."""
    appended: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    original = EvictionLayer.append

    def recording(layer, keys, values, positions):
        original(layer, keys, values, positions)
        appended.setdefault(id(layer), []).append((keys.clone(), layer.positions[..., -keys.shape[2] :].clone()))

    monkeypatch.setattr(EvictionLayer, "append", recording)
    return appended


@pytest.mark.parametrize("gqa", ["sum", "repeat"])
@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_knorm_keeps_the_lowest_norm_keys(regime, gqa, monkeypatch):
    """A key's norm does not change once cached, so whatever the order of evictions (one, per chunk, per token,
    while decoding) each layer ends with the ``BUDGET`` lowest-norm keys of all it was ever given, per cache head."""
    appended = appended_keys(monkeypatch)
    runner = engine(tiny_model(), "knorm", BUDGET, regime, gqa=gqa)
    cache = runner.new_cache(60)
    runner.prefill(cache, random_prompt(60))
    for step in range(4):  # decoding: evicts in chunked and streaming (decode_evict)
        runner.step(cache, [7 + step], 60 + step, evict=runner.decode_evict)
    heads = 4 if gqa == "repeat" else 2
    for layer in cache.eviction_layers:
        keys = torch.cat([keys for keys, _ in appended[id(layer)]], dim=2)  # [1,Hc,N,D]
        positions = torch.cat([positions for _, positions in appended[id(layer)]], dim=2)  # [1,Hc,N]
        assert keys.shape[1] == heads
        evictable = 60 if regime == "oneshot" else keys.shape[2]  # oneshot: decoding does not evict
        norms = keys[..., :evictable, :].double().norm(dim=-1)  # [1,Hc,N]
        for head in range(heads):
            held = layer.positions[0, head]
            kept_here = torch.isin(positions[0, head, :evictable], held)
            assert int(kept_here.sum()) == BUDGET  # the budget, and the tokens decoded after a oneshot prefill
            assert torch.equal(held[BUDGET:], positions[0, head, evictable:])
            # brute force: no evicted key has a lower norm than a kept one (up to KNorm's 16 significant bits)
            assert norms[0, head][kept_here].max() <= norms[0, head][~kept_here].min() * (1 + 2.0**-15)


def test_a_score_reads_the_layers_cache_and_weights(monkeypatch):
    """The context holds the layer's cached keys/values and positions and its output projection, per head: head
    ``h``'s output times ``W_O[h]``, summed over heads, is the layer's ``o_proj``."""
    model = tiny_model()
    contexts: list[ScoreContext] = []
    original = Policy.score

    def spying(policy, context):
        contexts.append(context)
        return original(policy, context)

    monkeypatch.setattr(Policy, "score", spying)
    runner = engine(model, "snapkv", BUDGET, window=4)
    cache = runner.new_cache(60)
    runner.prefill(cache, random_prompt(60))
    assert len(contexts) == 3
    for index, context in enumerate(contexts):
        assert context.keys.shape == context.values.shape == (1, 2, 60, 16)
        assert context.window is not None and context.window.queries.shape == (1, 4, 4, 16)
        assert context.weights is not None
        per_head = context.weights.output_per_head()  # [Hq,D,hidden]
        outputs = torch.randn(3, 4, 16)  # [n,Hq,D]
        o_proj = model.model.layers[index].self_attn.o_proj
        torch.testing.assert_close(torch.einsum("nhd,hdo->no", outputs, per_head), o_proj(outputs.flatten(1)))


def test_knorm_takes_no_attention_modifier():
    with pytest.raises(Exception, match="ranks tokens by its cached entries"):
        build_policy("knorm+caote")
    assert build_policy("knorm+calidrop").spec == "knorm+calidrop"
