"""CAOTE (Goel et al., 2025): re-rank a base score by the attention-output error its eviction causes."""

from dataclasses import dataclass

import torch

from kvbench.policies.base import Modifier, Policy
from kvbench.policies.registry import register
from kvbench.policies.scores import caote, fast_caote


@register
@dataclass
class CAOTE(Modifier):
    """``c_j = α_j/(1−α_j)·‖v_j − X_attn‖^power`` with α the base score normalised over the cache.

    ``power=None`` follows the paper per base: eq. 6 (``power=1``, the exact eviction error, Theorem A.2)
    for TOVA's probability vector; eq. 7 as printed (``power=2``) for the normalised H2O/SnapKV scores.
    """

    name = "caote"
    paper = "CAOTE (Goel et al., 2025)"

    power: float | None = None

    def bind(self, base: Policy) -> None:
        if self.power is None:
            self.power = 1.0 if base.name == "tova" else 2.0

    def transform(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return caote(scores, values.float(), self.power)  # CAOTE eq. (6)/(7)


@register
@dataclass
class FastCAOTE(CAOTE):
    """FastCAOTE: CAOTE with ``X_attn`` replaced by the mean value vector (CAOTE eq. 8)."""

    name = "fastcaote"

    def transform(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return fast_caote(scores, values.float(), self.power)  # CAOTE eq. (8)
