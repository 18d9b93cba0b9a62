"""OBCache (Optimal Brain Cache): Optimal-Brain-Damage saliency of pruning a token's value, key or both."""

from dataclasses import dataclass

import torch

from kvbench.policies.base import AttentionStats, Modifier
from kvbench.policies.registry import register
from kvbench.policies.scores import obcache
from kvbench.policies.stats import NormalisedBlock


def output_error_sums(
    block: NormalisedBlock, vv: torch.Tensor, vo: torch.Tensor | None = None, oo: torch.Tensor | None = None
) -> torch.Tensor:
    """``Σ_i A_ip² ‖α_ip v_p − β_ip o_i‖²`` over the block's queries, summed over each KV group ``[B,Hc,T_b]``.

    ``−A_ip(α_ip v_p − β_ip o_i)`` is the first-order change of ``o_i`` when token ``p`` is pruned; the caller
    gives the weight tiles ``vv = A²α²``, ``vo = A²αβ``, ``oo = A²β²`` ``[B,Hc,M,T_b]`` (None: ``β = 0``) and
    the sum expands into ``‖v_p‖² Σ_i vv − 2 v_p·Σ_i vo·o_i + Σ_i oo·‖o_i‖²``: one GEMM and one GEMV
    over the queries, nothing of size M×T×D."""
    sums = block.value_norms * vv.sum(dim=-2)  # [B,Hc,T_b]
    if vo is None:
        return sums
    assert oo is not None  # given with vo
    outputs = block.outputs.float()  # [B,Hc,M,D]
    cross = torch.matmul(vo.transpose(-1, -2), outputs)  # [B,Hc,T_b,D]  Σ_i vo_ip o_i
    outputs_sq = outputs.square().sum(dim=-1)[..., None, :]  # [B,Hc,1,M]
    cross = (cross * block.values.float()).sum(dim=-1)  # [B,Hc,T_b]  v_p·Σ_i vo_ip o_i
    return sums.sub_(cross, alpha=2.0).add_(torch.matmul(outputs_sq, oo)[..., 0, :])


def value_tiles(block: NormalisedBlock) -> tuple[torch.Tensor, None, None]:
    """``v_p → 0`` changes ``o_i`` by ``−A_ip v_p`` (α = 1, β = 0)."""
    return block.squared_weights(), None, None


def key_tiles(block: NormalisedBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Z_ip → 0`` changes ``o_i`` by ``−A_ip Z_ip (v_p − o_i)`` (α = β = Z): every tile is ``A²Z²``."""
    tile = block.squared_weights().mul_(block.logits).mul_(block.logits)
    return tile, tile, tile


def joint_tiles(block: NormalisedBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both change ``o_i`` by ``−A_ip ((1 + Z_ip) v_p − Z_ip o_i)`` (α = 1 + Z, β = Z); in place."""
    squared, logits = block.squared_weights(), block.logits  # A², Z
    mixed = squared * logits  # A²Z
    crossed = mixed * logits  # A²β² = A²Z²
    mixed.add_(crossed)  # A²αβ = A²Z(1 + Z)
    return squared.add_(mixed, alpha=2.0).sub_(crossed), mixed, crossed  # A²α², A²αβ, A²β²


TILES = {"value": value_tiles, "key": key_tiles, "joint": joint_tiles}


@dataclass
class OBCacheModifier(Modifier):
    """Replace the base's per-query ``A_ip`` by OBCache's second-order output error (Algorithm 1) over
    the base's window (TOVA: last query; SnapKV: observation window, then pooled; H2O: every query,
    accumulated over steps). GQA: per-query-head scores summed over the group (App. B.5). Each kind also
    gives the score from a normalised pass (``normalised_sums``, through ``output_error_sums``)."""

    paper = "OBCache: Optimal Brain KV Cache Pruning"
    reweights = True
    kind = "joint"

    def contributions(self, stats: AttentionStats) -> torch.Tensor:
        batch, q_heads, window, tokens = stats.weights.shape
        kv_heads, group = stats.keys.shape[1], stats.group_size
        scores = obcache(
            stats.weights.view(batch, kv_heads, group, window, tokens),
            stats.logits.view(batch, kv_heads, group, window, tokens),
            stats.outputs.view(batch, kv_heads, group, window, -1),
            stats.values.float()[:, :, None],
        )
        return getattr(scores, self.kind).reshape(batch, q_heads, 1, tokens)  # [B,Hq,1,T], summed over W

    def normalised_sums(self, block: NormalisedBlock) -> torch.Tensor:
        """The kind's output error from a normalised pass (:data:`TILES`)."""
        return output_error_sums(block, *TILES[self.kind](block))


@register
class OBCacheValue(OBCacheModifier):
    """``S_value = Σ_i A_ip²‖v_p‖²`` (OBCache eq. 4)."""

    name = "obcache_value"
    kind = "value"


@register
class OBCacheKey(OBCacheModifier):
    """``S_key = Σ_i A_ip² Z_ip² ‖v_p − o_i‖²`` (OBCache eq. 5)."""

    name = "obcache_key"
    kind = "key"


@register
class OBCacheJoint(OBCacheModifier):
    """``S_joint = 2Σ_i A_ip² Z_ip (‖v_p‖² − v_p·o_i) + S_value + S_key`` (OBCache eq. 6)."""

    name = "obcache_joint"
    kind = "joint"
