"""Closed-form token-eviction scores: CAOTE (Goel et al., 2025) and OBCache (Optimal Brain Cache).

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


@dataclass(frozen=True)
class OBCacheScores:
    """OBCache saliency per cached token, each ``[..., T]`` (high = keep): value, key and joint pruning."""

    value: torch.Tensor
    key: torch.Tensor
    joint: torch.Tensor


def obcache(attn: torch.Tensor, logits: torch.Tensor, outputs: torch.Tensor, values: torch.Tensor) -> OBCacheScores:
    """OBCache scores (eqs. 4–6, Algorithm 1) of the window queries ``i`` for every cached token ``p``.

    ``attn [..., W, T]`` = ``A_ip``, ``logits [..., W, T]`` = ``Z_ip = q_i·k_p/√d`` (raw, not centred; masked
    entries may be -inf where ``A_ip = 0``), ``outputs [..., W, D]`` = ``o_i = Σ_p A_ip v_p``,
    ``values [..., T, D]``. Each score is the OBD second-order term ``½ δᵀHδ = ‖J δ‖²`` of the window's
    output error ``Σ_i ‖ô_i − o_i‖²`` (eq. 3; no extra ½: the Hessian at zero residual is ``2JᵀJ``) for
    pruning ``v_p → 0`` (value; exact, the error is linear in V), ``k_p → 0`` i.e. ``Z_ip → 0`` (key) or both
    (joint):

    * ``value = Σ_i A_ip² ‖v_p‖²``
    * ``key   = Σ_i A_ip² Z_ip² ‖v_p − o_i‖²``
    * ``joint = 2 Σ_i A_ip² Z_ip (‖v_p‖² − v_p·o_i) + value + key``

    Cost O(W·T·D) through one ``[..., W, T]`` einsum; nothing of size ``W×T×D`` is built.
    """
    dtype = torch.promote_types(attn.dtype, values.dtype)
    attn, logits, outputs, values = (x.to(dtype) for x in (attn, logits, outputs, values))
    logits = logits.where(attn != 0, 0.0)  # masked (-inf) logits carry zero weight
    attn_sq = attn.square()  # [..., W, T]
    v_sq = values.square().sum(dim=-1)  # [..., T]     ‖v_p‖²
    o_sq = outputs.square().sum(dim=-1)  # [..., W]    ‖o_i‖²
    v_dot_o = torch.einsum("...wd,...td->...wt", outputs, values)  # [..., W, T]  v_p·o_i
    value = attn_sq.sum(dim=-2) * v_sq  # OBCache eq. (4)
    # ‖v_p − o_i‖² [..., W, T], kept ≥ 0 against rounding
    v_minus_o_sq = (v_sq.unsqueeze(-2) + o_sq.unsqueeze(-1) - 2.0 * v_dot_o).clamp_min(0.0)
    key = (attn_sq * logits.square() * v_minus_o_sq).sum(dim=-2)  # OBCache eq. (5)
    cross = 2.0 * (attn_sq * logits * (v_sq.unsqueeze(-2) - v_dot_o)).sum(dim=-2)
    return OBCacheScores(value=value, key=key, joint=cross + value + key)  # OBCache eq. (6)


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
