"""OBCache (Optimal Brain Cache): Optimal-Brain-Damage saliency of pruning a token's value, key or both."""

from dataclasses import dataclass

import torch

from kvbench.policies.base import AttentionStats, Modifier
from kvbench.policies.registry import register
from kvbench.policies.scores import obcache


@dataclass
class OBCacheModifier(Modifier):
    """Replace the base's per-query ``A_ip`` by OBCache's second-order output error (Algorithm 1) over
    the base's window (TOVA: last query; SnapKV: observation window, then pooled; H2O: every query,
    accumulated over steps). GQA: per-query-head scores summed over the group (App. B.5)."""

    paper = "OBCache: Optimal Brain KV Cache Pruning"
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


@register
@dataclass
class OBCacheValue(OBCacheModifier):
    """``S_value = Σ_i A_ip²‖v_p‖²`` (OBCache eq. 4)."""

    name = "obcache_value"
    kind = "value"


@register
@dataclass
class OBCacheKey(OBCacheModifier):
    """``S_key = Σ_i A_ip² Z_ip² ‖v_p − o_i‖²`` (OBCache eq. 5)."""

    name = "obcache_key"
    kind = "key"


@register
@dataclass
class OBCacheJoint(OBCacheModifier):
    """``S_joint = 2Σ_i A_ip² Z_ip (‖v_p‖² − v_p·o_i) + S_value + S_key`` (OBCache eq. 6)."""

    name = "obcache_joint"
    kind = "joint"
