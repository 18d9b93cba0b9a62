"""SLAKE's PTAA: the vectorised decode output equals eq. 13 evaluated token by token."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvbench.bench.measure import Operators
from kvbench.engine import Engine
from kvbench.engine.attention import sdpa_attention
from kvbench.engine.cache import EvictionCache
from kvbench.policies import build_policy
from kvbench.policies.methods.slake import (
    VABS_BLOCK,
    LinearState,
    Vabs,
    ptaa_attention,
    ptaa_weights,
    vabs_block,
    vabs_score,
)
from kvbench.policies.stats import AttentionStats
from tests.helpers import random_prompt, tiny_model
from tests.test_policies import KV_HEADS, Q_HEADS, SCALING, TOKENS, random_layer

GROUP = Q_HEADS // KV_HEADS


def loop_ptaa(query: list[float], kept: list[tuple], evicted: list[tuple]) -> list[float]:
    """Eq. 13 / Alg. 1 by explicit loops: kept ``(k, v)`` weigh ``e^{x−m}``, evicted ``e^{μ−m}(1 + x − μ)``
    with ``x = q·k/√d``, ``m`` the kept maximum and ``μ`` the evicted mean logit."""
    kept_logits = [sum(x * y for x, y in zip(query, k)) * SCALING for k, _ in kept]
    evicted_logits = [sum(x * y for x, y in zip(query, k)) * SCALING for k, _ in evicted]
    top = max(kept_logits)
    weights = [math.exp(x - top) for x in kept_logits]
    if evicted:
        mean = sum(evicted_logits) / len(evicted)
        weights += [math.exp(mean - top) * (1 + x - mean) for x in evicted_logits]
    values = [v for _, v in kept] + [v for _, v in evicted]
    total = sum(weights)
    return [sum(w * v[d] for w, v in zip(weights, values)) / total for d in range(len(query))]


def split(seed: int, kept_count: int):
    """A random GQA layer, one decode query per query head, and a different kept/evicted split per KV head."""
    queries, keys, values = random_layer(seed)
    generator = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(TOKENS, generator=generator) for _ in range(KV_HEADS)])[None]
    return queries[:, :, -1], keys, values, order[..., :kept_count], order[..., kept_count:]


def gather(tensor, index):
    return tensor.gather(2, index[..., None].expand(-1, -1, -1, tensor.shape[-1]))


@pytest.mark.parametrize("seed,kept_count", [(0, 12), (1, 30), (2, 1)])
def test_ptaa_matches_eq13_token_by_token(seed, kept_count):
    query, keys, values, kept, evicted = split(seed, kept_count)
    state = LinearState.of(gather(keys, evicted), gather(values, evicted))
    grouped = query.view(1, KV_HEADS, GROUP, -1)
    output = ptaa_attention(grouped, gather(keys, kept), gather(values, kept), state, SCALING)
    for q_head in range(Q_HEADS):
        head = q_head // GROUP
        kept_pairs, evicted_pairs = (
            [(keys[0, head, p].tolist(), values[0, head, p].tolist()) for p in index[0, head]]
            for index in (kept, evicted)
        )
        expected = loop_ptaa(query[0, q_head].tolist(), kept_pairs, evicted_pairs)
        torch.testing.assert_close(output[0, head, q_head % GROUP], torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_ptaa_output_is_its_attention_map_times_values():
    """The map VABS scores (``ptaa_weights``) is the one the decode output uses."""
    query, keys, values, kept, _ = split(3, 15)
    evicted = torch.ones(1, KV_HEADS, TOKENS, dtype=torch.bool).scatter_(-1, kept, False)
    logits = torch.einsum("bhgd,bhtd->bhgt", query.view(1, KV_HEADS, GROUP, -1), keys) * SCALING
    weights = ptaa_weights(logits, evicted[:, :, None])
    mapped = torch.einsum("bhgt,bhtd->bhgd", weights, values)
    dropped = evicted.nonzero()[:, -1].view(1, KV_HEADS, -1)
    state = LinearState.of(gather(keys, dropped), gather(values, dropped))
    output = ptaa_attention(
        query.view(1, KV_HEADS, GROUP, -1), gather(keys, kept), gather(values, kept), state, SCALING
    )
    torch.testing.assert_close(output, mapped, rtol=1e-4, atol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(1, KV_HEADS, GROUP))


@pytest.mark.parametrize(
    "window,tokens,per_query", [(32, 300, False), (300, 300, False), (5, 37, True), (130, 200, True), (1, 64, False)]
)
def test_ptaa_weights_are_the_plain_formula_bit_for_bit(window, tokens, per_query):
    """``ptaa_weights`` and ``vabs_score`` work in place on their large buffers, the score a block of queries at a
    time; every weight equals eq. 11's plain (allocating, whole-window) evaluation exactly, and the score eqs. 15-18's,
    so VABS's allocations are unchanged."""
    generator = torch.Generator().manual_seed(window + tokens)
    logits = torch.randn(2, 9, window, tokens, generator=generator) * 4
    causal = torch.arange(tokens)[None, :] <= torch.arange(tokens - window, tokens)[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    evicted = torch.rand(2, 9, window if per_query else 1, tokens, generator=generator) < 0.8
    evicted[0, 0] = False  # a head that evicted nothing: softmax
    gone = evicted & torch.isfinite(logits)
    kept_logits = logits.masked_fill(gone, float("-inf"))
    mean = logits.masked_fill(~gone, 0.0).sum(dim=-1, keepdim=True) / gone.sum(dim=-1, keepdim=True).clamp_min(1)
    reference = torch.maximum(kept_logits.amax(dim=-1, keepdim=True), mean)
    linear = torch.exp(mean - reference) * (1.0 + logits - mean)
    unnormalised = torch.where(gone, linear, torch.exp(kept_logits - reference))
    approximate = unnormalised / unnormalised.sum(dim=-1, keepdim=True)
    assert torch.equal(ptaa_weights(logits, evicted), approximate)
    weights, share = logits.softmax(-1), torch.rand(2, 9, 1, tokens, generator=generator)
    error = (approximate - weights).abs()
    plain = ((0.5 * error.sum(dim=-1)) * (share * error).sum(dim=-1) ** 0.1).mean() ** 0.5 * torch.tensor(2.0) ** 0.4
    # eqs. 15-18, VABS_BLOCK queries at a time (a window of 300 is five blocks), or the whole window at once (as on
    # an accelerator, vabs_block): the same score
    for block in (None, window):
        score = vabs_score(weights, logits, evicted, share, torch.tensor(2.0), 0.5, 0.4, 0.1, block)
        assert float(score) == float(plain)


def test_vabs_blocks_are_small_on_a_cpu_and_fill_their_bytes_elsewhere():
    """On a CPU a block of VABS's window is ``VABS_BLOCK`` queries; on another device (meta here) as many as keep a
    working copy within ``VABS_BYTES``: a 1k-token window at once (one block's operators instead of 16), an 8B model's
    32 heads at 32k in blocks of 64."""
    assert vabs_block(torch.zeros(1, 9, 1024, 1024)) == VABS_BLOCK == 64
    assert vabs_block(torch.empty(1, 9, 1024, 1024, device="meta")) == 7281
    assert vabs_block(torch.empty(1, 32, 32768, 32768, device="meta")) == 64
    counted = {}
    for device in ("meta", "cpu"):
        logits, share = torch.zeros(1, 9, 1024, 1024, device=device), torch.zeros(1, 9, 1, 1024, device=device)
        evicted = torch.zeros(1, 9, 1, 1024, dtype=torch.bool, device=device)
        with Operators() as operators:
            vabs_score(logits, logits, evicted, share, torch.zeros((), device=device), 0.5, 0.4, 0.1)
        counted[device] = operators.launched
    assert counted["cpu"] > 10 * counted["meta"]


def test_ptaa_without_evicted_tokens_is_softmax_attention():
    query, keys, values, _, _ = split(4, TOKENS)
    empty = LinearState.of(keys[:, :, :0], values[:, :, :0])
    grouped = query.view(1, KV_HEADS, GROUP, -1)
    output = ptaa_attention(grouped, keys, values, empty, SCALING)
    logits = torch.einsum("bhgd,bhtd->bhgt", grouped, keys) * SCALING
    torch.testing.assert_close(output, torch.einsum("bhgt,bhtd->bhgd", logits.softmax(-1), values))
    torch.testing.assert_close(ptaa_weights(logits, torch.zeros(1, 1, 1, TOKENS, dtype=torch.bool)), logits.softmax(-1))


def test_linear_state_folds_exactly_the_evicted_entries():
    """After one prefill eviction the layer's state is ``Σ k_eᵀv_e``, ``Σ k_e``, ``Σ v_e``, ``ℓ`` of the
    tokens the cache no longer holds (per KV head)."""
    queries, keys, values = random_layer(5)
    cache = EvictionCache(build_policy("snapkv+slake", {"window": 8}), [16], TOKENS, Q_HEADS, KV_HEADS)
    cache.begin_forward(torch.arange(TOKENS), evict=True)
    cache.update(keys, values, 0)
    cache.after_attention(0, queries, sdpa_attention(queries, keys, values, SCALING), SCALING)
    layer = cache.layers[0]
    state = layer.modifier_state["slake"].linear
    assert torch.equal(state.count, torch.full((1, KV_HEADS), float(TOKENS - 16)))
    for head in range(KV_HEADS):
        gone = sorted(set(range(TOKENS)) - set(layer.positions[0, head].tolist()))
        k, v = keys[0, head, gone], values[0, head, gone]
        torch.testing.assert_close(state.linear[0, head], k.T @ v)
        torch.testing.assert_close(state.key_sum[0, head], k.sum(0))
        torch.testing.assert_close(state.value_sum[0, head], v.sum(0))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("regime", ["oneshot", "streaming"])
def test_budget_at_least_prompt_equals_full(llama, regime):
    prompt = random_prompt(90)
    full = Engine(llama, build_policy("full"), 4096, regime=regime).generate(prompt, max_new_tokens=10)
    slake = Engine(llama, build_policy("snapkv+slake"), 90, regime=regime).generate(prompt, max_new_tokens=10)
    assert slake.token_ids == full.token_ids


@torch.inference_mode()
def test_decode_with_ptaa_is_close_to_full():
    """After a prefill eviction to 32 of 120 tokens, the next token's logits under PTAA are far closer to
    the full cache's than plain SnapKV's: with small weights (init 0.05) the attention logits are small
    and the first-order Taylor term is accurate, so a wrong state or scaling would show."""
    model = tiny_model("llama", initializer_range=0.05)
    prompt, budget = random_prompt(120), 32
    logits = {}
    for spec in ("full", "snapkv", "snapkv+slake"):
        runner = Engine(
            model, build_policy(spec, {} if spec == "full" else {"window": 8}), budget if spec != "full" else 4096
        )
        cache = runner.new_cache(len(prompt))
        runner.prefill(cache, prompt)
        logits[spec] = runner.step(cache, [7], len(prompt), evict=False)[0, -1]
        if spec != "full":
            assert cache.tokens_per_layer() == [budget + 1] * 3
    error = {spec: (logits[spec] - logits["full"]).norm() for spec in ("snapkv", "snapkv+slake")}
    assert error["snapkv+slake"] < 0.05 * error["snapkv"]


def test_cake_slake_allocates_with_vabs_unless_told_otherwise():
    assert build_policy("cake+slake").layer_budget.name == "vabs"
    assert build_policy("cake+slake", {"layer_budget": "cake"}).layer_budget.name == "cake"
    assert build_policy("cake").layer_budget.name == "cake"
    assert build_policy("snapkv+slake").layer_budget.name == "uniform"


def window_stats(tokens: int, window: int, generator: torch.Generator) -> AttentionStats:
    """The statistics of the last ``window`` of ``tokens`` random queries over their keys (GQA groups of GROUP)."""
    queries = torch.randn(1, Q_HEADS, window, 16, generator=generator) * 2
    keys, values = (torch.randn(1, KV_HEADS, tokens, 16, generator=generator) for _ in range(2))
    positions = torch.arange(tokens)
    return AttentionStats(queries, keys, values, positions[-window:], positions.expand(1, KV_HEADS, -1), SCALING)


@pytest.mark.parametrize("window,tokens", [(32, 300), (300, 300), (1, 64)])
def test_vabs_preferences_asked_together_equal_each_alone(window, tokens):
    """A shared prefill's SLAKE variants ask one window's statistics for their VABS preferences
    (``AttentionStats.together``): computed when the layer ends (``settle``) in one pass over the stacked evicted sets,
    each equals the preference computed alone (each query's terms are its own row's) bit for bit — eq. (16)'s power
    is taken in float64, since in float32 a CPU's vector and scalar paths round one unit in the last place apart (seen
    at window 1 on an AMD EPYC with AVX-512) — and the pass's operators do not grow with the variants."""
    generator = torch.Generator().manual_seed(window)
    stats = window_stats(tokens, window, generator)
    budgets = [Vabs(alpha=alpha, beta=beta) for alpha, beta in ((0.5, 0.4), (1.0, 0.2), (0.3, 1.5), (0.5, 0.4))]
    evicted = [torch.rand(1, KV_HEADS, tokens, generator=generator) < share for share in (0.2, 0.5, 0.8, 0.9)]
    alone = [float(budget.preference(stats, each)) for budget, each in zip(budgets, evicted)]
    shared = replace(stats, batched=True)
    asked = [budget.preference(shared, each) for budget, each in zip(budgets, evicted)]
    assert len(shared.waiting[("vabs", 0.1)][1]) == 4
    shared.settle()
    assert [float(each) for each in asked] == alone
    assert not shared.waiting
    counted = []  # on an accelerator (meta here) a pass's operators, by the variants asking
    for variants in (1, 4):
        tensors = ("queries", "keys", "values", "query_positions", "key_positions")
        meta = replace(stats, batched=True, **{name: getattr(stats, name).to("meta") for name in tensors})
        with Operators() as operators:
            for budget, each in zip(budgets[:variants], evicted):
                budget.preference(meta, each.to("meta"))
            meta.settle()
        counted.append(operators.launched)
    assert counted[1] < 1.5 * counted[0]  # four variants' preferences for not much more than one's


def test_a_settled_window_computes_what_is_asked_later_on_its_own():
    """What is asked after a settle waits for the next one; statistics not batched compute at once."""
    generator = torch.Generator().manual_seed(1)
    stats = window_stats(64, 8, generator)
    budget, evicted = Vabs(alpha=0.5, beta=0.4), torch.rand(1, KV_HEADS, 64, generator=generator) < 0.5
    alone = float(budget.preference(stats, evicted))
    assert not stats.waiting  # computed at once
    shared = replace(stats, batched=True)
    first = budget.preference(shared, evicted)
    shared.settle()
    second = budget.preference(shared, evicted)
    assert len(shared.waiting[("vabs", budget.gamma)][1]) == 1
    shared.settle()
    assert float(first) == float(second) == alone
