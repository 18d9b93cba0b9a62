"""Each method as its paper ran it: the engine-level consequences of the per-paper settings."""

from __future__ import annotations

import pytest
import torch

from kvbench.config import compose
from kvbench.engine import Engine
from kvbench.errors import KVBenchError
from kvbench.job import resolve
from kvbench.policies import build_policy
from tests.helpers import engine, random_prompt, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def kept_after_prefill(runner: Engine, prompt: list[int]) -> list[torch.Tensor]:
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    return cache.kept_positions()


def test_windowed_h2o_is_snapkv_without_pooling_in_the_engine(llama):
    """``h2o window=16 score_window=16`` generates and keeps exactly what ``snapkv window=16 pool=none`` does
    (OBCache App. C.2.1's "SnapKV's version of H2O"); H2O over every query keeps something else."""
    prompt = random_prompt(160)
    windowed = engine(llama, "h2o", 48, window=16, score_window=16)
    snapkv = engine(llama, "snapkv", 48, window=16, pool="none")
    assert windowed.generate(prompt, 12).token_ids == snapkv.generate(prompt, 12).token_ids
    pairs = zip(kept_after_prefill(windowed, prompt), kept_after_prefill(snapkv, prompt))
    assert all(torch.equal(a, b) for a, b in pairs)
    full_history = kept_after_prefill(engine(llama, "h2o", 48, window=16), prompt)
    assert any(not torch.equal(a, b) for a, b in zip(full_history, kept_after_prefill(windowed, prompt)))


def test_tova_layer_mode_keeps_one_token_set_per_layer(llama):
    prompt = random_prompt(120)
    layer = kept_after_prefill(engine(llama, "tova", 40), prompt)
    assert all(torch.equal(positions[0, 0], positions[0, 1]) for positions in layer)
    head = kept_after_prefill(engine(llama, "tova", 40, heads="head"), prompt)
    assert any(not torch.equal(positions[0, 0], positions[0, 1]) for positions in head)
    decoded = engine(llama, "tova", 40, regime="streaming")
    cache = decoded.new_cache(len(prompt))
    decoded.prefill(cache, prompt)
    assert all(torch.equal(positions[0, 0], positions[0, 1]) for positions in cache.kept_positions())


def test_a_window_filling_the_budget_is_an_error():
    with pytest.raises(KVBenchError, match=r"policy h2o reserves 5000 of its 5000-token budget .* no heavy hitters"):
        resolve(
            compose(
                [
                    "+experiment=obcache",
                    "model=llama31_8b",
                    "task=longbench",
                    "policy=h2o",
                    "budget=5pct",
                    "policy.window=5pct",
                    "policy.score_window=5pct",
                ]
            )
        )
    with pytest.raises(KVBenchError, match="no heavy hitters"):
        engine(tiny_model("llama"), "snapkv", 32, window=32).generate(random_prompt(100), 2)


@pytest.mark.parametrize("budget", ["5pct", "10pct", "20pct"])
def test_obcache_experiment_leaves_heavy_hitter_slots(budget):
    job = resolve(
        compose(["+experiment=obcache", "model=llama31_8b", "task=longbench", "policy=h2o", f"budget={budget}"])
    )
    prompt = 10_000
    tokens = job.budget.resolve(prompt)
    assert 0 < job.policy.reserved_recent(tokens, prompt) < tokens
    assert job.policy.scoring_window(tokens, prompt) == job.policy.reserved_recent(tokens, prompt)


@pytest.mark.model
def test_obcache_h2o_and_snapkv_keep_different_tokens_on_a_real_prompt():
    """At every budget of ``+experiment=obcache`` the prefill H2O and SnapKV keep different token sets on a
    real text (SmolLM2, 768 tokens of the Paul Graham essays), as Table 4's different rows require."""
    from kvbench.models import load_model, model_config
    from kvbench.resources import paul_graham_essays

    loaded = load_model(model_config("smollm2_135m"))
    prompt = loaded.tokenizer(paul_graham_essays()[:20_000])["input_ids"][:768]
    for budget in ("5pct", "10pct", "20pct"):
        kept = {}
        for spec in ("h2o", "snapkv"):
            job = resolve(
                compose(
                    [
                        "+experiment=obcache",
                        "model=smollm2_135m",
                        "task=longbench",
                        f"policy={spec}",
                        f"budget={budget}",
                    ]
                )
            )
            kept[spec] = kept_after_prefill(Engine(loaded.model, job.policy, job.budget), prompt)
        assert any(not torch.equal(a, b) for a, b in zip(kept["h2o"], kept["snapkv"])), budget


def test_cake_scores_the_current_query_alone_while_decoding():
    """CAKE's released decoding eviction (``CakeDecodingKVCache_LayerWise``): the attention of the current
    query only (no variance term, no remembered window), the window kept; prefill still uses the window."""
    from kvbench.engine.attention import sdpa_attention
    from kvbench.engine.cache import EvictionCache
    from tests.test_policies import KV_HEADS, Q_HEADS, SCALING, TOKENS, head_scores, random_layer, top_positions

    budget, window = 20, 8
    cake = build_policy("cake", {"window": window, "layer_budget": "uniform", "pool": "none"})
    assert cake.scoring_window(budget, TOKENS, decoding=True) == 1 and cake.scoring_window(budget, TOKENS) == window
    cache = EvictionCache(cake, [budget], TOKENS - 1, Q_HEADS, KV_HEADS)
    queries, keys, values = random_layer(11)
    cache.begin_forward(torch.arange(TOKENS - 1), evict=False)
    cache.update(keys[:, :, :-1], values[:, :, :-1], 0)
    cache.after_attention(
        0, queries[:, :, :-1], sdpa_attention(queries[:, :, :-1], keys[:, :, :-1], values[:, :, :-1], SCALING), SCALING
    )
    cache.begin_forward(torch.tensor([TOKENS - 1]), evict=True, decoding=True)
    cache.update(keys[:, :, -1:], values[:, :, -1:], 0)
    cache.after_attention(0, queries[:, :, -1:], sdpa_attention(queries[:, :, -1:], keys, values, SCALING), SCALING)
    prefix = list(range(TOKENS - window))
    for head in range(KV_HEADS):
        scores = head_scores(queries, keys, head, [TOKENS - 1])
        expected = set(range(TOKENS - window, TOKENS)) | top_positions(scores, prefix, budget - window)
        assert set(cache.layers[0].positions[0, head].tolist()) == expected


def test_non_causal_h2o_scores_differently_but_attends_causally(llama):
    """KVCache-Factory's pre-fix H2O (``causal=false``) changes what is kept, not the prompt's attention: the
    first generated token (the prefill's logits, before any eviction matters) equals the full cache's."""
    prompt = random_prompt(150)
    full = engine(llama, "full", 4096).generate(prompt, 1).token_ids
    non_causal = engine(llama, "h2o", 48, window=8, causal=False)
    causal = engine(llama, "h2o", 48, window=8)
    assert non_causal.generate(prompt, 1).token_ids == full
    assert any(
        not torch.equal(a, b)
        for a, b in zip(kept_after_prefill(non_causal, prompt), kept_after_prefill(causal, prompt))
    )
