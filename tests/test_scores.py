"""CAOTE and OBCache scores against brute force computed independently (float64)."""

import math

import pytest
import torch
from torch.autograd.functional import hvp, jacobian

from kvbench.errors import KVBenchError
from kvbench.policies.scores import OBCacheScores, caote, fast_caote, obcache, reduce_gqa

B, H, T, D = 2, 3, 9, 5


@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def softmax_weights(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(2.0 * torch.randn(*shape, generator=gen(seed)), dim=-1)


def brute_eviction_error(alpha: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``‖X_attn − X̃_attn,j‖`` by really removing token j and renormalising the rest (CAOTE eqs. 4–5)."""
    tokens = alpha.shape[-1]
    x_attn = (alpha[..., None] * values).sum(-2)
    errors = []
    for j in range(tokens):
        keep = [i for i in range(tokens) if i != j]
        rest = alpha[..., keep] / alpha[..., keep].sum(-1, keepdim=True)
        x_evicted = (rest[..., None] * values[..., keep, :]).sum(-2)
        errors.append((x_attn - x_evicted).norm(dim=-1))
    return torch.stack(errors, dim=-1)


# --- CAOTE -------------------------------------------------------------------------------------------


def test_caote_is_exact_eviction_error():
    alpha, values = softmax_weights(B, H, T), torch.randn(B, H, T, D, generator=gen(1))
    torch.testing.assert_close(caote(alpha, values), brute_eviction_error(alpha, values), rtol=0, atol=1e-12)


def test_caote_normalises_unnormalised_scores_eq7():
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    attention = torch.softmax(torch.randn(B, H, T, T, generator=gen(2)).masked_fill(~causal, -math.inf), -1)
    h2o = attention.sum(dim=-2)  # column sums: Σ_j h_j = T > 1 (CAOTE Theorem C.1)
    values = torch.randn(B, H, T, D, generator=gen(3))
    assert torch.allclose(h2o.sum(-1), torch.full((B, H), float(T)))
    expected = brute_eviction_error(h2o / h2o.sum(-1, keepdim=True), values)
    torch.testing.assert_close(caote(h2o, values), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(caote(3.0 * h2o, values), caote(h2o, values), rtol=1e-12, atol=0)


def test_caote_power_two_squares_only_the_norm():
    alpha, values = softmax_weights(B, H, T, seed=4), torch.randn(B, H, T, D, generator=gen(5))
    x_attn = (alpha[..., None] * values).sum(-2)
    distance = torch.stack([(values[..., j, :] - x_attn).norm(dim=-1) for j in range(T)], dim=-1)
    expected = alpha / (1 - alpha) * distance**2  # eq. (7) as printed
    torch.testing.assert_close(caote(alpha, values, power=2.0), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(caote(alpha, values, power=2.0), caote(alpha, values) * distance, rtol=1e-12, atol=0)


def test_fast_caote_uses_mean_value():
    weights, values = softmax_weights(B, H, T, seed=6) * 7.0, torch.randn(B, H, T, D, generator=gen(7))
    alpha = weights / weights.sum(-1, keepdim=True)
    mean_value = values.sum(-2) / T
    expected = torch.stack(
        [alpha[..., j] / (1 - alpha[..., j]) * (mean_value - values[..., j, :]).norm(dim=-1) for j in range(T)], -1
    )
    torch.testing.assert_close(fast_caote(weights, values), expected, rtol=1e-12, atol=0)
    squared = expected * expected / (alpha / (1 - alpha))
    torch.testing.assert_close(fast_caote(weights, values, power=2.0), squared, rtol=1e-12, atol=0)


@pytest.mark.parametrize("score", [caote, fast_caote])
def test_caote_finite_when_one_token_holds_all_mass(score):
    values = torch.randn(T, D, generator=gen(8))
    one_hot = torch.zeros(T).index_fill(0, torch.tensor([2]), 1.0)
    peaked = torch.softmax(torch.tensor([40.0] + [0.0] * (T - 1), dtype=torch.float32), -1)  # rounds to 1.0
    assert peaked[0] == 1.0
    assert torch.isfinite(score(one_hot, values)).all()
    assert torch.isfinite(score(peaked, values.float())).all()


def test_caote_gqa_broadcast_and_dtype_promotion():
    kv_heads, group = 2, 3
    weights = softmax_weights(B, kv_heads * group, T, seed=9).float()
    values = torch.randn(B, kv_heads, T, D, generator=gen(10)).bfloat16()
    repeated = caote(weights, values.repeat_interleave(group, dim=1))
    grouped = caote(weights.unflatten(1, (kv_heads, group)), values.unsqueeze(2))
    assert repeated.dtype == torch.float32
    torch.testing.assert_close(grouped.flatten(1, 2), repeated)


# --- OBCache -----------------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference ``softmax(q kᵀ/√d) v`` for one head: ``q [W,d]``, ``k [T,d]``, ``v [T,D]``."""
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v


def stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(A, Z, O)`` for any leading dims."""
    logits = torch.einsum("...wd,...td->...wt", q, k) / math.sqrt(q.shape[-1])
    attn = torch.softmax(logits, dim=-1)
    return attn, logits, attn @ v


def pruning(k: torch.Tensor, v: torch.Tensor, p: int, key: bool, value: bool):
    """OBCache's row-wise pruning perturbation ``e_pᵀ[K̂ V̂] = 0``: ``δk_p = −k_p``, ``δv_p = −v_p``."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if key:
        dk[p] = -k[p]
    if value:
        dv[p] = -v[p]
    return dk, dv


def output_jacobians(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Autograd Jacobians of one head's outputs w.r.t. K and V: ``[W,D,T,d]``, ``[W,D,T,D]``."""
    return jacobian(lambda k_, v_: attention(q, k_, v_), (k, v))


def gauss_newton_error(jacobians: list, k, v, p: int, key: bool, value: bool) -> torch.Tensor:
    """``‖J δ‖²``: first-order output change summed over the query heads (one Jacobian pair each) sharing k, v."""
    dk, dv = pruning(k, v, p, key, value)
    deltas = [torch.einsum("wetc,tc->we", jk, dk) + torch.einsum("wetc,tc->we", jv, dv) for jk, jv in jacobians]
    return sum(delta.square().sum() for delta in deltas)


def half_hessian_error(q, k, v, p: int, key: bool, value: bool) -> torch.Tensor:
    """``½ δᵀ H δ`` with H the exact Hessian of ``‖Ô − O‖_F²`` at (K, V) (OBCache eqs. 2–3)."""
    reference = attention(q, k, v).detach()
    dk, dv = pruning(k, v, p, key, value)
    _, (h_dk, h_dv) = hvp(lambda k_, v_: (attention(q, k_, v_) - reference).square().sum(), (k, v), (dk, dv))
    return 0.5 * ((dk * h_dk).sum() + (dv * h_dv).sum())


def random_qkv(seed: int, *lead: int, window: int = 4, tokens: int = 7, dk: int = 6, dv: int = 5):
    g = gen(seed)
    return (
        torch.randn(*lead, window, dk, generator=g),
        torch.randn(*lead, tokens, dk, generator=g),
        torch.randn(*lead, tokens, dv, generator=g),
    )


def test_obcache_value_score_is_exact_zeroing_error():
    q, k, v = random_qkv(11, B, H)
    scores = obcache(*stats(q, k, v), v)
    for p in range(k.shape[-2]):
        zeroed = v.clone()
        zeroed[..., p, :] = 0.0
        error = (stats(q, k, v)[2] - stats(q, k, zeroed)[2]).square().sum(dim=(-1, -2))
        torch.testing.assert_close(scores.value[..., p], error, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("field", "key", "value"), [("value", False, True), ("key", True, False), ("joint", True, True)]
)
def test_obcache_scores_are_second_order_pruning_error(field, key, value):
    q, k, v = random_qkv(12, B, H)
    scores = getattr(obcache(*stats(q, k, v), v), field)
    for b in range(B):
        for h in range(H):
            jacobians = [output_jacobians(q[b, h], k[b, h], v[b, h])]
            for p in range(k.shape[-2]):
                args = (k[b, h], v[b, h], p, key, value)
                expected = gauss_newton_error(jacobians, *args)
                torch.testing.assert_close(scores[b, h, p], expected, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(half_hessian_error(q[b, h], *args), expected, rtol=1e-10, atol=1e-12)


def test_obcache_key_score_uses_raw_logits():
    """Shifting a row's logits leaves A and O unchanged but not the key score: Z enters uncentred."""
    q, k, v = random_qkv(13)
    attn, logits, outputs = stats(q, k, v)
    shifted = obcache(attn, logits + 1.0, outputs, v)
    assert not torch.allclose(shifted.key, obcache(attn, logits, outputs, v).key)


def test_obcache_gqa_sums_query_heads_of_a_group():
    kv_heads, group = 2, 3
    g = gen(14)
    q = torch.randn(B, kv_heads * group, 4, 6, generator=g)
    k, v = torch.randn(B, kv_heads, 7, 6, generator=g), torch.randn(B, kv_heads, 7, 5, generator=g)
    attn, logits, outputs = stats(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    per_query_head = obcache(attn, logits, outputs, v.repeat_interleave(group, 1))
    grouped = obcache(*(x.unflatten(1, (kv_heads, group)) for x in (attn, logits, outputs)), v.unsqueeze(2))
    for field in ("value", "key", "joint"):
        reduced = reduce_gqa(getattr(per_query_head, field), kv_heads)
        torch.testing.assert_close(getattr(grouped, field).sum(dim=2), reduced, rtol=1e-12, atol=1e-12)
        key, value = field != "value", field != "key"
        for b in range(B):
            for kv in range(kv_heads):
                group_heads = range(kv * group, (kv + 1) * group)  # H(g) (OBCache App. B.5)
                jacobians = [output_jacobians(q[b, h], k[b, kv], v[b, kv]) for h in group_heads]
                for p in range(k.shape[-2]):
                    expected = gauss_newton_error(jacobians, k[b, kv], v[b, kv], p, key, value)
                    torch.testing.assert_close(reduced[b, kv, p], expected, rtol=1e-10, atol=1e-12)


def test_obcache_masked_logits_are_safe():
    q, k, v = random_qkv(15, H)
    logits = torch.einsum("...wd,...td->...wt", q, k) / math.sqrt(q.shape[-1])
    future = torch.ones(4, 7, dtype=torch.bool).triu(4)  # query i sees tokens <= 3 + i
    masked = logits.masked_fill(future, -math.inf)
    attn = torch.softmax(masked, dim=-1)
    outputs = attn @ v
    scores = obcache(attn, masked, outputs, v)
    reference = obcache(attn, logits.masked_fill(future, 0.0), outputs, v)
    assert isinstance(scores, OBCacheScores)
    for field in ("value", "key", "joint"):
        assert torch.isfinite(getattr(scores, field)).all()
        torch.testing.assert_close(getattr(scores, field), getattr(reference, field), rtol=0, atol=0)


def test_obcache_promotes_bf16_values():
    q, k, v = random_qkv(16, H)
    attn, logits, outputs = (x.float() for x in stats(q, k, v))
    scores = obcache(attn, logits, outputs, v.bfloat16())
    assert scores.joint.dtype == torch.float32 and scores.joint.shape == (H, 7)


# --- GQA reduction -----------------------------------------------------------------------------------


def test_reduce_gqa_modes_match_explicit_groups():
    kv_heads, group = 4, 2
    scores = torch.randn(B, kv_heads * group, T, generator=gen(17))
    groups = [scores[:, kv * group : (kv + 1) * group] for kv in range(kv_heads)]
    torch.testing.assert_close(reduce_gqa(scores, kv_heads), torch.stack([x.sum(1) for x in groups], 1))
    torch.testing.assert_close(reduce_gqa(scores, kv_heads, "mean"), torch.stack([x.mean(1) for x in groups], 1))
    assert reduce_gqa(scores, kv_heads, "repeat") is scores
    torch.testing.assert_close(reduce_gqa(scores, kv_heads * group), scores)


def test_reduce_gqa_rejects_bad_input():
    with pytest.raises(KVBenchError, match="GQA reduction"):
        reduce_gqa(torch.zeros(4, T), 2, "max")
    with pytest.raises(KVBenchError, match="do not split"):
        reduce_gqa(torch.zeros(6, T), 4)
