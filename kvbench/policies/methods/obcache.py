"""OBCache (Optimal Brain Cache): Optimal-Brain-Damage saliency of pruning a token's value, key or both."""

from dataclasses import dataclass

import torch

from kvbench.policies.base import Modifier
from kvbench.policies.registry import register
from kvbench.policies.scores import OBCACHE_TERMS, obcache_sums
from kvbench.policies.stats import QueryBlock


@dataclass
class OBCacheModifier(Modifier):
    """Replace the base's per-query ``A_ip`` by OBCache's second-order output error (Algorithm 1) over
    the base's window (TOVA: last query; SnapKV: observation window, then pooled; H2O: every query,
    accumulated over steps). GQA: per-query-head scores summed over the group (App. B.5)."""

    paper = "OBCache: Optimal Brain KV Cache Pruning"
    reweights = True
    kind = "joint"

    def contribution_sums(self, block: QueryBlock) -> torch.Tensor:
        return obcache_sums(block, self.kind)  # OBCache eqs. (4)–(6)

    def sum_terms(self) -> tuple[float, float, float]:
        return OBCACHE_TERMS[self.kind]


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
