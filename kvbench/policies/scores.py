"""Closed-form token-eviction scores: CAOTE (Goel et al., 2025) and OBCache (Optimal Brain Cache), each written once.

Pure tensor functions, importable without a model. Shapes: ``...`` any leading batch/head dims (broadcast
between arguments), ``T`` cached tokens, ``W`` scoring-window queries, ``D`` head dim.

GQA: every score here is per query head. Either repeat the KV heads to the query heads first
(``values.repeat_interleave(Hq // Hkv, dim=-3)``, transformers' ``repeat_kv`` layout) or, without copying,
view the query-head axis as ``[Hkv, G]`` and give ``values`` a singleton group axis ``[..., Hkv, 1, T, D]``;
then ``reduce_gqa`` (or a sum over ``G``) folds the scores onto the KV heads (OBCache App. B.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvbench.errors import KVBenchError, choose
from kvbench.policies.stats import QueryBlock, QueryTerms


def _normalise(weights: torch.Tensor) -> torch.Tensor:
    """``α_j = h_j / Σ_i h_i`` over the last axis: CAOTE eq. (7) (a no-op for softmax weights)."""
    return weights / weights.sum(dim=-1, keepdim=True)


def _caote_about(alpha: torch.Tensor, values: torch.Tensor, centre: torch.Tensor, power: float) -> torch.Tensor:
    """``α_j/(1−α_j) · ‖v_j − centre‖^power``: alpha ``[..., T]``, values ``[..., T, D]``, centre ``[..., D]``.

    ``1 − α_j`` is clamped at the dtype's machine epsilon: when one token holds (numerically) all the mass,
    evicting it leaves nothing to renormalise (0/0 in eq. 4); the clamp keeps the score finite."""
    ratio = alpha / (1.0 - alpha).clamp_min(torch.finfo(alpha.dtype).eps)  # [..., T]
    distance = torch.linalg.vector_norm(values - centre.unsqueeze(-2), dim=-1)  # [..., T]
    return ratio * distance.pow(power)


def _common_dtype(weights: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(weights.dtype, values.dtype)
    return weights.to(dtype), values.to(dtype)


def caote(weights: torch.Tensor, values: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """CAOTE score ``c_j = α_j/(1−α_j) · ‖v_j − X_attn‖^power``, ``X_attn = Σ_i α_i v_i``: ``[..., T]``.

    ``weights [..., T]`` are attention weights (TOVA) or any non-negative base score (H2O, SnapKV), normalised
    to sum to one over T (eq. 7); ``values [..., T, D]``. ``power=1`` is eq. 6, the exact single-token eviction
    error ``‖X_attn − X̃_attn,j‖`` (Theorem A.2); ``power=2`` is eq. 7 as printed (only the norm squared).
    Low score = evict. Multi-token eviction (block-wise prefill) is greedy, as in the paper (§3.2, App. B, G):
    evict the m lowest one-shot scores, ignoring how each removal re-normalises the others.
    """
    weights, values = _common_dtype(weights, values)
    alpha = _normalise(weights)  # [..., T]
    x_attn = torch.einsum("...t,...td->...d", alpha, values)  # [..., D]
    return _caote_about(alpha, values, x_attn, power)  # CAOTE eq. (6) / (7)


def fast_caote(weights: torch.Tensor, values: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """FastCAOTE ``c_j = α_j/(1−α_j) · ‖v̄ − v_j‖^power`` with ``v̄`` the mean value vector: ``[..., T]``.

    Same arguments and normalisation as ``caote``; ``X_attn`` is replaced by ``v̄ = Σ_i v_i / T``."""
    weights, values = _common_dtype(weights, values)
    return _caote_about(_normalise(weights), values, values.mean(dim=-2), power)  # CAOTE eq. (8)


def output_error_sums(
    block: QueryBlock, vv: torch.Tensor, vo: torch.Tensor | None = None, oo: torch.Tensor | None = None
) -> torch.Tensor:
    """``Σ_i A_ip² ‖α_ip v_p − β_ip o_i‖²`` over the block's query rows ``[..., T]``.

    ``−A_ip(α_ip v_p − β_ip o_i)`` is the first-order change of ``o_i`` when token ``p`` is pruned; the caller
    gives the weight tiles ``vv = A²α²``, ``vo = A²αβ``, ``oo = A²β²`` ``[..., M, T]`` (None: ``β = 0``) and
    the sum expands into ``‖v_p‖² Σ_i vv − 2 v_p·Σ_i vo·o_i + Σ_i oo·‖o_i‖²``: one GEMM and one GEMV
    over the queries, nothing of size M×T×D."""
    sums = block.value_norms * vv.sum(dim=-2)  # [..., T]
    if vo is None:
        return sums
    assert oo is not None  # given with vo
    outputs = block.outputs.to(vv.dtype)  # [..., M, D]
    cross = torch.matmul(vo.transpose(-1, -2), outputs)  # [..., T, D]  Σ_i vo_ip o_i
    outputs_sq = outputs.square().sum(dim=-1)[..., None, :]  # [..., 1, M]
    cross = (cross * block.values.to(vv.dtype)).sum(dim=-1)  # [..., T]  v_p·Σ_i vo_ip o_i
    return sums.sub_(cross, alpha=2.0).add_(torch.matmul(outputs_sq, oo)[..., 0, :])


def value_tiles(block: QueryBlock) -> tuple[torch.Tensor, None, None]:
    """``v_p → 0`` changes ``o_i`` by ``−A_ip v_p`` (α = 1, β = 0)."""
    return block.squared_weights(), None, None


def key_tiles(block: QueryBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Z_ip → 0`` changes ``o_i`` by ``−A_ip Z_ip (v_p − o_i)`` (α = β = Z): every tile is ``A²Z²``."""
    tile = block.squared_weights().mul_(block.logits).mul_(block.logits)
    return tile, tile, tile


def joint_tiles(block: QueryBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both change ``o_i`` by ``−A_ip ((1 + Z_ip) v_p − Z_ip o_i)`` (α = 1 + Z, β = Z); in place."""
    squared, logits = block.squared_weights(), block.logits  # A², Z
    mixed = squared * logits  # A²Z
    crossed = mixed * logits  # A²β² = A²Z²
    mixed.add_(crossed)  # A²αβ = A²Z(1 + Z)
    return squared.add_(mixed, alpha=2.0).sub_(crossed), mixed, crossed  # A²α², A²αβ, A²β²


#: OBCache's pruning kinds: the tiles of each one's first-order output change
OBCACHE_TILES = {"value": value_tiles, "key": key_tiles, "joint": joint_tiles}
#: the same as ``(a0, a1, b1)`` of ``α = a0 + a1·Z``, ``β = b1·Z`` (the fused pass: :mod:`kvbench.kernels.sums`)
OBCACHE_TERMS = {"value": (1.0, 0.0, 0.0), "key": (0.0, 1.0, 1.0), "joint": (1.0, 1.0, 1.0)}


def obcache_sums(block: QueryBlock, kind: str) -> torch.Tensor:
    """OBCache's saliency of pruning each cached token's value, key or both (``kind``), summed over the block's query
    rows ``[..., T]`` (high = keep): the OBD second-order term ``½ δᵀHδ = ‖J δ‖²`` of the output error
    ``Σ_i ‖ô_i − o_i‖²`` (eq. 3; no extra ½: the Hessian at zero residual is ``2JᵀJ``) for ``v_p → 0`` (value; exact,
    the error is linear in V), ``k_p → 0`` i.e. ``Z_ip → 0`` (key) or both (joint):

    * ``value = Σ_i A_ip² ‖v_p‖²``                                  (eq. 4)
    * ``key   = Σ_i A_ip² Z_ip² ‖v_p − o_i‖²``                      (eq. 5)
    * ``joint = 2 Σ_i A_ip² Z_ip (‖v_p‖² − v_p·o_i) + value + key``  (eq. 6)

    each as ``Σ_i A_ip² ‖α_ip v_p − β_ip o_i‖²`` (:func:`output_error_sums`)."""
    return output_error_sums(block, *OBCACHE_TILES[kind](block))


@dataclass(frozen=True)
class OBCacheScores:
    """OBCache saliency per cached token, each ``[..., T]`` (high = keep): value, key and joint pruning."""

    value: torch.Tensor
    key: torch.Tensor
    joint: torch.Tensor


def obcache(attn: torch.Tensor, logits: torch.Tensor, outputs: torch.Tensor, values: torch.Tensor) -> OBCacheScores:
    """:func:`obcache_sums` of every kind from explicit tensors: ``attn [..., W, T]`` = ``A_ip``, ``logits [..., W, T]``
    = ``Z_ip = q_i·k_p/√d`` (raw, not centred; masked entries may be -inf where ``A_ip = 0``), ``outputs [..., W, D]``
    = ``o_i = Σ_p A_ip v_p``, ``values [..., T, D]``; in their promoted dtype."""
    dtype = torch.promote_types(attn.dtype, values.dtype)
    attn, logits, outputs, values = (x.to(dtype) for x in (attn, logits, outputs, values))
    terms = QueryTerms(attn, logits.where(attn != 0, 0.0), outputs, values)  # masked (-inf) logits carry no weight
    return OBCacheScores(*(obcache_sums(terms, kind) for kind in ("value", "key", "joint")))


#: how per-query-head scores fold onto KV heads (:func:`reduce_gqa`)
GqaMode = Literal["sum", "mean", "repeat"]


def reduce_gqa(scores: torch.Tensor, num_kv_heads: int, mode: GqaMode = "sum") -> torch.Tensor:
    """Fold per-query-head scores ``[..., Hq, T]`` onto KV heads ``[..., Hkv, T]``.

    Query head ``h`` belongs to KV head ``h // (Hq / Hkv)`` (transformers' ``repeat_kv`` layout). ``sum`` is
    OBCache App. B.5 (eqs. 33–35: the group's summed output error); ``mean`` averages the group; ``repeat``
    returns the scores unchanged (SnapKV/KVCache-Factory layout: one cache per query head).
    """
    choose("GQA reduction", mode, ("sum", "mean", "repeat"))
    if mode == "repeat":
        return scores
    if scores.shape[-2] % num_kv_heads:
        raise KVBenchError(f"{scores.shape[-2]} query heads do not split into {num_kv_heads} KV-head groups")
    grouped = scores.unflatten(-2, (num_kv_heads, -1))  # [..., Hkv, G, T]
    return grouped.sum(dim=-2) if mode == "sum" else grouped.mean(dim=-2)
