"""KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the keys least similar to the cache's mean key direction."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.registry import register


@register
@dataclass
class KeyDiff(Policy):
    """Score ``s_p = −CosSim(μ(K̂), k_p)`` per cache head, the anchor ``μ(K̂) = mean_p k_p/‖k_p‖`` over the cached keys
    (KeyDiff §3): distinctive keys are kept, no attention read; nothing reserved, as kvpress's ``KeyDiffPress``.
    Evicting in blocks (``engine.regime=chunked``) recomputes the anchor over each block's cache: the paper's
    block-wise iteration (kvpress's ``BlockPress(KeyDiffPress)``)."""

    name = "keydiff"
    paper = "KeyDiff (arXiv 2504.15364)"

    @property
    def statistic(self) -> Statistic:
        return "entries"

    def score(self, context: ScoreContext) -> torch.Tensor:
        keys = context.keys.float()  # [B,Hc,T,D]
        anchor = F.normalize(keys, dim=-1).mean(dim=2, keepdim=True)  # [B,Hc,1,D]
        return -F.cosine_similarity(keys, anchor, dim=-1)  # [B,Hc,T]
