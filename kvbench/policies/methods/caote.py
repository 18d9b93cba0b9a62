"""CAOTE (Goel et al., 2025): re-rank a base score by the attention-output error its eviction causes."""

from dataclasses import dataclass

import torch

from kvbench.domains import number, setting
from kvbench.policies.base import Modifier
from kvbench.policies.context import ScoreContext
from kvbench.policies.registry import register
from kvbench.policies.scores import caote, fast_caote


@register
@dataclass
class CAOTE(Modifier):
    """``c_j = α_j/(1−α_j)·‖v_j − X_attn‖^power`` with α the base score normalised over the cache.

    ``power=1`` (default, every base) is eq. 6: the exact single-token eviction error (Theorem A.2), which
    eq. 8, the text ("converts any such scores to a probability simplex and then applies (6)") and the
    paper's summary also use unsquared; ``power=2`` is eq. 7 as printed for the normalised H2O/SnapKV
    scores, the one place the norm is squared.
    """

    name = "caote"
    paper = "CAOTE (Goel et al., 2025)"
    transforms = True

    power: float = setting(number(0, low_open=True), 1.0)

    def transform(self, scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        return caote(scores, context.values.float(), self.power)  # CAOTE eq. (6) (power=2: eq. (7) as printed)


@register
@dataclass
class FastCAOTE(CAOTE):
    """FastCAOTE: CAOTE with ``X_attn`` replaced by the mean value vector (CAOTE eq. 8, unsquared)."""

    name = "fastcaote"

    def transform(self, scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        return fast_caote(scores, context.values.float(), self.power)  # CAOTE eq. (8)
