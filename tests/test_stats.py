"""Sums from the per-query normaliser (kvbench.policies.stats) against the float32 reference path.

The reference is ``Policy.summed_contributions`` over ``AttentionStats`` (float32 softmax, then the paper's
per-query term, summed): the normalised pass must give the same scores (float32: up to rounding; bfloat16:
within its tolerance), and through the engine the same kept token sets, with the normaliser from its own blocks
(the CPU default) and from the fused kernel (``attention_with_lse``).
"""

from __future__ import annotations

import pytest
import torch

from kvbench.engine import attention
from kvbench.engine import scoring as scoring_module
from kvbench.engine.attention import attention_with_lse
from kvbench.policies import build_policy
from kvbench.policies.base import AttentionStats
from kvbench.policies.stats import NormalisedStats
from tests.helpers import engine, random_prompt, tiny_model

Q_HEADS, KV_HEADS, DIM, TOKENS = 6, 2, 16, 50
SCALING = DIM**-0.5
SPECS = ["h2o", "h2o+obcache_value", "h2o+obcache_key", "h2o+obcache_joint"]


def forward(q_len: int, heads: int = KV_HEADS, dtype=torch.float32, seed: int = 0):
    """A forward of ``q_len`` queries at the end of a ``TOKENS``-slot cache whose older slots hold gappy,
    per-head positions (an evicted cache): queries, keys, values and the positions of both."""
    generator = torch.Generator().manual_seed(seed)
    past = TOKENS - q_len
    old = torch.stack([torch.randperm(2 * past, generator=generator)[:past].sort().values for _ in range(heads)])
    new = torch.arange(2 * past, 2 * past + q_len)
    key_positions = torch.cat([old, new.expand(heads, -1)], dim=1)[None]  # [1,Hc,T]
    queries = torch.randn(1, Q_HEADS, q_len, DIM, generator=generator) * 2
    keys = torch.randn(1, heads, TOKENS, DIM, generator=generator) * 2
    values = torch.randn(1, heads, TOKENS, DIM, generator=generator)
    return queries.to(dtype), keys.to(dtype), values.to(dtype), new, key_positions


def brute_force(queries, keys, values):
    """Float64 bottom-right causal attention, per query head: outputs ``[B,Hq,q,D]`` and lse ``[B,Hq,q]``."""
    group = queries.shape[1] // keys.shape[1]
    keys, values = (x.double().repeat_interleave(group, dim=1) for x in (keys, values))
    logits = torch.einsum("bhqd,bhtd->bhqt", queries.double(), keys) * SCALING
    mask = attention.bottom_right_causal_mask(queries.shape[2], keys.shape[2], queries.device)
    logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(dim=-1) @ values, logits.logsumexp(dim=-1)


def normalised(queries, keys, values, source: str) -> NormalisedStats:
    """The pass's inputs: the kernel's outputs and normaliser, or the exact outputs and no normaliser (blocks)."""
    if source == "kernel":
        outputs, lse = attention_with_lse(queries, keys, values, SCALING)
        return NormalisedStats(queries, keys, values, SCALING, outputs, lse)
    return NormalisedStats(queries, keys, values, SCALING, brute_force(queries, keys, values)[0].to(queries.dtype))


@pytest.mark.parametrize("q_len", [TOKENS, 17, 1])
def test_attention_with_lse_matches_brute_force(q_len):
    queries, keys, values, _, _ = forward(q_len)
    outputs, lse = attention_with_lse(queries, keys, values, SCALING)
    expected_outputs, expected_lse = brute_force(queries, keys, values)
    assert lse.dtype == torch.float32 and lse.shape == (1, Q_HEADS, q_len)
    torch.testing.assert_close(outputs.double(), expected_outputs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["blocks", "kernel"])
@pytest.mark.parametrize("block_size", [1, 7, None])
@pytest.mark.parametrize("q_len", [TOKENS, 17, 1])
@pytest.mark.parametrize("spec", SPECS)
def test_normalised_sums_equal_the_float32_reference(spec, q_len, block_size, source):
    queries, keys, values, query_positions, key_positions = forward(q_len)
    policy = build_policy(spec, {})
    reference = policy.summed_contributions(
        AttentionStats(queries, keys, values, query_positions, key_positions, SCALING), block_size
    )
    summed = policy.normalised_sums(normalised(queries, keys, values, source), block_size)
    torch.testing.assert_close(summed, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gqa", ["mean", "repeat"])
def test_gqa_reductions_match_the_reference(gqa):
    """``mean`` divides the group's sum; ``repeat`` caches one head per query head (a group of one)."""
    heads = Q_HEADS if gqa == "repeat" else KV_HEADS
    queries, keys, values, query_positions, key_positions = forward(TOKENS, heads=heads)
    policy = build_policy("h2o+obcache_joint", {"gqa": gqa})
    stats = AttentionStats(queries, keys, values, query_positions, key_positions, SCALING)
    reference = policy.summed_contributions(stats)
    summed = policy.normalised_sums(normalised(queries, keys, values, "kernel"), 8)
    assert summed.shape == (1, heads, TOKENS)
    torch.testing.assert_close(summed, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_bfloat16_sums_stay_within_its_rounding(spec):
    """In bfloat16 the logits come from bfloat16 inputs with float32 accumulation and the kernel's float32
    normaliser: the scores match the float32 reference on the same (rounded) inputs to bfloat16 precision."""
    queries, keys, values, query_positions, key_positions = forward(TOKENS, dtype=torch.bfloat16)
    policy = build_policy(spec, {})
    rounded = (queries.float(), keys.float(), values.float())
    reference = policy.summed_contributions(AttentionStats(*rounded, query_positions, key_positions, SCALING))
    for source in ("blocks", "kernel"):
        summed = policy.normalised_sums(normalised(queries, keys, values, source), 16)
        torch.testing.assert_close(summed, reference, rtol=0.03, atol=0.03 * reference.abs().max().item())


def kept_and_tokens(model, spec: str, regime: str, prompt: list[int]):
    runner = engine(model, spec, 40, regime)
    output = runner.generate(prompt, max_new_tokens=6)
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    return [positions.tolist() for positions in cache.kept_positions()], output.token_ids


@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
@pytest.mark.parametrize("spec", SPECS)
def test_engine_keeps_the_reference_token_sets(spec, regime, monkeypatch):
    """Through the model: the normalised pass (blockwise, and from the fused kernel) keeps exactly the tokens
    that the reference path (float32 ``summed_contributions``, the ``running`` statistic) keeps, and generates
    the same."""
    model, prompt = tiny_model(), random_prompt(130)
    normalised_run = kept_and_tokens(model, spec, regime, prompt)
    with monkeypatch.context() as patch:
        patch.setattr(attention, "NORMALISER_KERNEL_DEVICES", {"cpu"})
        kernel_run = kept_and_tokens(model, spec, regime, prompt)
    with monkeypatch.context() as patch:
        patch.setattr(scoring_module, "uses_normaliser", lambda policy: False)
        reference_run = kept_and_tokens(model, spec, regime, prompt)
    assert normalised_run == reference_run and kernel_run == reference_run


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_len", [TOKENS, 17, 1])
def test_cuda_kernel_normaliser_matches_the_reference(q_len, dtype):
    """The CUDA kernels (flash in bfloat16, memory-efficient in float32) give the normaliser and outputs."""
    queries, keys, values, query_positions, key_positions = forward(q_len, dtype=dtype)
    policy = build_policy("h2o+obcache_joint", {})
    rounded = (queries.float(), keys.float(), values.float())
    reference = policy.summed_contributions(AttentionStats(*rounded, query_positions, key_positions, SCALING))
    cuda = [x.cuda() for x in (queries, keys, values)]
    stats = normalised(*cuda, "kernel")
    summed = policy.normalised_sums(stats)
    tolerance = 0.03 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(summed.cpu(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())
    expected = brute_force(*rounded)[0]
    torch.testing.assert_close(stats.outputs.cpu().double(), expected, rtol=tolerance, atol=tolerance)
