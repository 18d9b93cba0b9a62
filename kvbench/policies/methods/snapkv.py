"""SnapKV (Li et al., 2024, arXiv 2404.14469): observation-window attention, pooled, plus the window."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.domains import choice, integer, setting, token_window, window_tokens
from kvbench.policies.base import Policy
from kvbench.policies.registry import register


@register
@dataclass
class SnapKV(Policy):
    """Score ``Σ_{i∈window} A_ip`` then 1-D pooling over tokens (SnapKV Alg. 1); the window is kept."""

    name = "snapkv"
    paper = "SnapKV (arXiv 2404.14469)"

    #: the observation window: its queries score, its tokens are kept
    window: Any = setting(token_window(1), 32)
    pool: str = setting(choice("avg", "max", "none"), "avg")
    #: pooling kernel over tokens (1: no pooling)
    kernel: int = setting(integer(1, "a kernel width"), 5)

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return max(1, window_tokens(self.window, budget, prompt_len))

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        return window_tokens(self.window, budget, prompt_len)

    def pool_scores(self, scores: torch.Tensor, recent: int) -> torch.Tensor:
        """Stride-1 pooling (``kernel // 2`` padding) over the prefix ``[B,H,:T-recent]``; the window as is."""
        prefix_len = scores.shape[-1] - recent
        if self.pool == "none" or self.kernel <= 1 or prefix_len <= 0:
            return scores
        prefix = scores[..., :prefix_len].reshape(-1, 1, prefix_len)
        pooling = F.avg_pool1d if self.pool == "avg" else F.max_pool1d
        pooled = pooling(prefix, kernel_size=self.kernel, stride=1, padding=self.kernel // 2)[..., :prefix_len]
        return torch.cat([pooled.reshape(*scores.shape[:-1], prefix_len), scores[..., prefix_len:]], dim=-1)
