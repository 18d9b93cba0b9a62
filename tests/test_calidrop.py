"""CaliDrop: the decomposition merge is exact, and recomputing every step reproduces full attention."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine import Engine
from kvbench.engine.attention import sdpa_attention
from kvbench.engine.cache import EvictionCache
from kvbench.errors import KVBenchError
from kvbench.policies import build_policy
from kvbench.policies.context import Evicted
from kvbench.policies.methods.calidrop import CaliDrop, attention_lse, merge_attention
from tests.helpers import random_prompt, tiny_model
from tests.test_policies import KV_HEADS, Q_HEADS, SCALING, TOKENS, random_layer

BUDGET, NEW_TOKENS = 40, 10
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def needle_prompt(tokenizer, noise_lines: int, depth: float, key: str, value: int) -> list[int]:
    """A chat-formatted needle-in-noise question (RULER niah_single_1 style) with its answer prefix."""
    lines = [NOISE] * noise_lines
    lines.insert(round(depth * noise_lines), f"One of the special magic numbers for {key} is: {value}.")
    question = f"What is the special magic number for {key} mentioned in the provided text?"
    messages = [{"role": "user", "content": "\n".join(lines) + "\n" + question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text + f"The special magic number for {key} mentioned in the provided text is")["input_ids"]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def smollm2_needle():
    from kvbench.models import load_model, model_config

    loaded = load_model(model_config("smollm2_135m"))
    return loaded.model, needle_prompt(loaded.tokenizer, 16, 0.4, "wistful-harbor", 7301942)


def generate(model, spec, budget=BUDGET, regime="oneshot", prompt_len=150, **params):
    runner = Engine(model, build_policy(spec, params), budget, regime=regime, block_size=16)
    return runner.generate(random_prompt(prompt_len), max_new_tokens=NEW_TOKENS)


def direct_attention(query, keys, values):
    """Float64 softmax attention of ``query [B,Hq,D]`` over ``keys``/``values [B,Hkv,T,D]`` (GQA repeat)."""
    group = query.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    logits = torch.einsum("bhd,bhtd->bht", query.double(), k) * SCALING
    return logits.logsumexp(-1), torch.einsum("bht,bhtd->bhd", logits.softmax(-1), v)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decomposition_merge_is_full_attention(seed):
    """Eqs. 1–2: merging the (lse, out) of a kept / evicted partition (different per KV head) is exact."""
    _, keys, values = random_layer(seed)
    generator = torch.Generator().manual_seed(seed + 10)
    query = torch.randn(2, Q_HEADS, keys.shape[-1], generator=generator) * 2
    keys, values = keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1)
    order = torch.stack([torch.randperm(TOKENS, generator=generator) for _ in range(2 * KV_HEADS)]).view(
        2, KV_HEADS, -1
    )
    split = 13

    def part(index):
        slots = index[..., None].expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, slots), values.gather(2, slots)

    grouped = query.view(2, KV_HEADS, Q_HEADS // KV_HEADS, -1)
    lse_a, out_a = attention_lse(grouped, *part(order[..., :split]), SCALING)
    lse_b, out_b = attention_lse(grouped, *part(order[..., split:]), SCALING)
    lse, out = merge_attention(lse_a, out_a, lse_b, out_b)
    expected_lse, expected_out = direct_attention(query, keys, values)
    torch.testing.assert_close(lse.reshape(2, Q_HEADS).double(), expected_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.reshape(2, Q_HEADS, -1).double(), expected_out, rtol=1e-5, atol=1e-5)


def test_later_evictions_merge_into_the_cached_state():
    """Entries evicted in two rounds leave ``C_lse, C_out`` equal to attention of ``C_q`` over their union."""
    queries, keys, values = random_layer(3)
    modifier, last_query = CaliDrop(), queries[:, :, -1]
    state = modifier.new_state()
    rounds = [slice(0, 10), slice(10, 25)]
    for part in rounds:
        positions = torch.arange(TOKENS)[part].expand(1, KV_HEADS, -1)
        evicted = Evicted(keys[:, :, part], values[:, :, part], positions, torch.rand(positions.shape))
        modifier.on_evict(state, evicted, last_query, SCALING)
    expected_lse, expected_out = direct_attention(last_query, keys[:, :, :25], values[:, :, :25])
    torch.testing.assert_close(state.lse.reshape(1, Q_HEADS).double(), expected_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.out.reshape(1, Q_HEADS, -1).double(), expected_out, rtol=1e-5, atol=1e-5)
    assert len(state.store) == 25


def test_calib_size_keeps_the_best_scored_evicted_entries():
    queries, keys, values = random_layer(4)
    limited, unlimited = ({"calib_size": 7}, {})
    kept = []
    for params in (limited, unlimited):
        cache = EvictionCache(build_policy("snapkv+calidrop", {"window": 8, **params}), [16], TOKENS, Q_HEADS, KV_HEADS)
        cache.begin_forward(torch.arange(TOKENS), evict=True)
        cache.update(keys, values, 0)
        cache.after_attention(0, queries, sdpa_attention(queries, keys, values, SCALING), SCALING)
        kept.append(cache.layers[0].modifier_state["calidrop"].store)
    small, everything = kept
    assert small.keys.shape == (1, KV_HEADS, 7, keys.shape[-1]) and len(everything) == TOKENS - 16
    for head in range(KV_HEADS):
        best = everything.scores[0, head].topk(7).indices
        assert set(small.positions[0, head].tolist()) == set(everything.positions[0, head, best].tolist())


@pytest.mark.parametrize("spec", ["snapkv+calidrop", "h2o+calidrop", "sink+calidrop"])
def test_recomputing_every_step_equals_full(llama, spec):
    """θ1 > 1 recomputes with every decode query over all evicted entries: full attention, while the
    cache itself holds only the budget (plus the appended decode tokens)."""
    full = generate(llama, "full", 4096)
    output = generate(llama, spec, theta1=1.5)
    assert output.token_ids == full.token_ids
    assert output.kv.after_prefill_tokens_per_layer == [BUDGET] * 3
    assert output.policy_stats["recompute_rate"] == 1.0
    assert output.policy_stats["recompute_rate_per_layer"] == [1.0] * 3
    runner = Engine(llama, build_policy(spec, {"theta1": 1.5}), BUDGET)
    cache = runner.new_cache(150)
    with torch.inference_mode():
        runner.prefill(cache, random_prompt(150))
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape == (1, KV_HEADS, BUDGET, 16)
        assert layer.modifier_state["calidrop"].store.keys.shape == (1, KV_HEADS, 150 - BUDGET, 16)


@pytest.mark.parametrize("offload", [False, True])
def test_streaming_evictions_join_the_evicted_set(llama, offload):
    """Token-by-token eviction (every step) with θ1 > 1 still equals full: later evictions join the set."""
    full = generate(llama, "full", 4096, "streaming", prompt_len=60)
    output = generate(llama, "h2o+calidrop", 24, "streaming", prompt_len=60, theta1=1.5, offload=offload)
    assert output.token_ids == full.token_ids
    assert output.kv.peak_tokens_per_layer == [25] * 3


def test_never_calibrating_equals_the_base(llama):
    base = generate(llama, "snapkv")
    output = generate(llama, "snapkv+calidrop", theta1=-1.5, theta2=1.5)
    assert output.token_ids == base.token_ids
    assert output.policy_stats["recompute_rate"] == 0.0


def test_bad_calib_size_is_one_line_error():
    message = r"^policy.calib_size=0: must be null \(every evicted entry\) or a token count ≥ 1$"
    with pytest.raises(KVBenchError, match=message):
        build_policy("snapkv+calidrop", {"calib_size": 0})


@pytest.mark.model
def test_smollm2_recomputing_every_step_equals_full(smollm2_needle):
    model, prompt = smollm2_needle
    budget = 64

    def run(spec, budget, **params):
        return Engine(model, build_policy(spec, params), budget).generate(prompt, max_new_tokens=12)

    full = run("full", 4096)
    output = run("snapkv+calidrop", budget, theta1=1.5)
    assert output.token_ids == full.token_ids
    assert output.kv.after_prefill_tokens_per_layer == [budget] * 30
    assert output.policy_stats["recompute_rate"] == 1.0
