"""Expected Attention (``expected_attention``) keeps, at every eviction, the top of its closed form computed by
brute force in float64: the queries taken before RoPE from the model's own ``q_proj`` (not un-rotated), RoPE's
rotations built pair by pair from ``inv_freq``, the expected logit ``μ̄·k/√d + ½ kᵀΣ̄k/d`` per query head."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

from kvbench.errors import KVBenchError
from kvbench.policies import build_policy
from kvbench.policies.context import ScoreContext
from tests.helpers import engine, random_prompt, tiny_model

BUDGET, SINKS, FUTURE = 24, 2, 16


def averaged_rotation(inv_freq: torch.Tensor, start: int, factor: float = 1.0) -> torch.Tensor:
    """``mean_n R(n)`` over positions ``start .. start+FUTURE−1``, each ``R(n)`` rotating the pair ``(i, i+D/2)``
    by ``n·θ_i`` and scaling it by a scaled RoPE's attention ``factor`` (YaRN's): ``[D,D]`` float64."""
    half = inv_freq.shape[0]
    total = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for position in range(start, start + FUTURE):
        for i, theta in enumerate(inv_freq.double().tolist()):
            c, s = math.cos(position * theta), math.sin(position * theta)
            total[i, i] += c
            total[i + half, i + half] += c
            total[i, i + half] -= s
            total[i + half, i] += s
    return total * factor / FUTURE


def expected_scores(queries, keys, values, start, inv_freq, factor: float = 1.0) -> torch.Tensor:
    """One layer's scores from its pre-RoPE ``queries [Hq,N,D]`` (the sinks' left out) and cache ``keys``/``values
    [Hc,T,D]`` (float64): the sinks first (infinite), then the expected attention averaged over the group, × ‖v‖."""
    rotation = averaged_rotation(inv_freq, start, factor)
    group, dim = queries.shape[0] // keys.shape[0], keys.shape[-1]
    scores = torch.zeros(keys.shape[:2], dtype=torch.float64)
    for head in range(queries.shape[0]):
        mean = queries[head].mean(dim=0)
        centred = queries[head] - mean
        covariance = rotation @ (centred.T @ centred / queries.shape[1]) @ rotation.T
        cached = keys[head // group, SINKS:]
        logits = cached @ (rotation @ mean) / math.sqrt(dim) + ((cached @ covariance) * cached).sum(-1) / dim / 2
        scores[head // group, SINKS:] += torch.softmax(logits, dim=0) / group
    scores[:, SINKS:] *= values[:, SINKS:].norm(dim=-1)
    scores[:, :SINKS] = math.inf
    return scores


@pytest.mark.parametrize("architecture", ["llama", "gpt_oss"])  # GPT-OSS: YaRN, its cos/sin one per pair
@pytest.mark.parametrize("gqa", ["sum", "repeat"])
@pytest.mark.parametrize("regime", ["oneshot", "chunked"])
def test_expected_attention_keeps_the_top_of_its_closed_form(regime, gqa, architecture):
    model = tiny_model(architecture)
    inv_freq, factor = model.model.rotary_emb.inv_freq, model.model.rotary_emb.attention_scaling
    seen: dict[int, list[torch.Tensor]] = {}  # layer → the pre-RoPE queries of every forward [Hq,q,D]
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn

        def record(module, inputs, output, index=index, dim=attention.head_dim):
            seen.setdefault(index, []).append(output[0].view(output.shape[1], -1, dim).transpose(0, 1).double())

        attention.q_proj.register_forward_hook(record)
    evictions: list[bool] = []

    @contextmanager
    def checked(layer_idx, budget, scores, layer):  # EvictionCache.watch
        keys, values, positions = layer.keys[0].double(), layer.values[0].double(), layer.positions[0].clone()
        queries = torch.cat(seen[layer_idx], dim=1)[:, SINKS:]  # every query seen, the sinks' left out
        start = int(positions.max()) + 1
        yield
        expected = expected_scores(queries, keys, values, start, inv_freq, factor)
        if gqa == "repeat":  # each query head its own cache head
            expected = torch.stack(
                [
                    expected_scores(queries[h : h + 1], keys[h : h + 1], values[h : h + 1], start, inv_freq, factor)[0]
                    for h in range(keys.shape[0])
                ]
            )
        for head in range(keys.shape[0]):
            kept = torch.isin(positions[head], layer.positions[0, head])
            separated = bool(expected[head][kept].min() > expected[head][~kept].max())
            evictions.append(int(kept.sum()) == budget and separated)

    runner = engine(model, "expected_attention", BUDGET, regime, gqa=gqa, n_sink=SINKS, n_future_positions=FUTURE)
    cache = runner.new_cache(60)
    cache.watch = checked
    runner.prefill(cache, random_prompt(60))
    assert len(evictions) >= 2 and all(evictions)  # GPT-OSS: its one global layer, two heads
    assert cache.eviction_layers[0].keys.shape[1] == (4 if gqa == "repeat" else 2)


def test_expected_attention_without_a_rotary_embedding_is_one_line():
    policy = build_policy("expected_attention")
    keys = torch.zeros(1, 2, 8, 4)
    with pytest.raises(KVBenchError, match="rotary embedding"):
        policy.score(ScoreContext(keys, keys, torch.arange(8).expand(1, 2, 8), None, 0))


@pytest.mark.parametrize("regime,decode_evict", [("oneshot", False), ("chunked", False), ("oneshot", True)])
def test_the_prompts_queries_are_held_only_while_an_eviction_may_read_them(regime, decode_evict):
    """Expected Attention's window is every query of the prompt: once no forward evicts after it, no layer holds it
    (32 layers × the prompt's queries would outweigh the kept cache); where decoding evicts, each layer keeps it."""
    runner = engine(tiny_model(), "expected_attention", BUDGET, regime, n_sink=SINKS, n_future_positions=FUTURE)
    runner.decode_evict = decode_evict
    output = runner.generate(random_prompt(60), 3)
    cache = runner.new_cache(60)
    runner.prefill(cache, random_prompt(60))
    held = [layer.recent_queries is not None for layer in cache.eviction_layers]
    assert held == [decode_evict] * len(held)
    assert len(output.token_ids) == 3


@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_the_next_position_comes_from_the_host_and_is_one_past_the_newest_entry(regime, monkeypatch):
    """Expected Attention averages RoPE from the next position on: the cache hands it over as counted on the host (no
    value read back from the device at every layer), one past the newest cached position at every eviction, prefill
    and decode; its window's queries are the positions just before it, so the sinks' are cut by a slice (a mask's
    shape would be read back)."""
    from kvbench.policies.methods.expected_attention import ExpectedAttention

    seen: list[tuple[int | None, int]] = []
    score = ExpectedAttention.score

    def recording(policy, context):
        seen.append((context.next_position, int(context.positions.max()) + 1))
        positions = context.window.query_positions
        assert positions.tolist() == list(range(context.next_position - len(positions), context.next_position))
        return score(policy, context)

    monkeypatch.setattr(ExpectedAttention, "score", recording)
    runner = engine(tiny_model(), "expected_attention", BUDGET, regime, n_sink=SINKS, n_future_positions=FUTURE)
    runner.generate(random_prompt(60), 4)
    assert len(seen) >= 3 and all(given == newest for given, newest in seen)


def test_the_covariance_term_in_blocks_of_keys_keeps_what_it_keeps_whole(monkeypatch):
    """``SPREAD_KEYS``: the ``Σ̄k`` of blocks of keys, each key's ``kᵀΣ̄k`` its own (blocks of 7 over a 150-token
    cache: the same kept positions and tokens as one block)."""
    from kvbench.policies.methods import expected_attention

    model, prompt = tiny_model(), random_prompt(150)
    spec = {"n_sink": SINKS, "n_future_positions": FUTURE}
    runner = engine(model, "expected_attention", BUDGET, **spec)
    runner.record_kept = True
    whole = runner.generate(prompt, 4)
    monkeypatch.setattr(expected_attention, "SPREAD_KEYS", 7)
    blocked = runner.generate(prompt, 4)
    assert whole.kept is not None and (blocked.token_ids, blocked.kept) == (whole.token_ids, whole.kept)
