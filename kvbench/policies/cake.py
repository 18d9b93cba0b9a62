"""CAKE (Qin et al., ICLR 2025, arXiv 2503.12491): attention-shift tolerant indicator, preference budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.policies.base import AttentionStats
from kvbench.policies.registry import register
from kvbench.policies.scores import reduce_gqa
from kvbench.policies.snapkv import SnapKV


@register
@dataclass
class Cake(SnapKV):
    """CAKE's eviction indicator ``I_p = Mean_i(A_ip) + γ·Var_i(A_ip)`` over the observation window
    (unbiased variance over its queries), pooled like SnapKV (avg, kernel 5) with the window kept, and
    budgets from CAKE's layer preferences with cascading prefill (``layer_budget=cake``, see
    ``kvbench.policies.budgets``). ``γ = 200``, window 32 and the pooling are the defaults of CAKE's
    released code (``experiments/LongBench/pred_cake.py``, ``cake/model/modify_llama.py``); ``tau1``/``tau2``
    default to 1.0 there and are tuned per model and budget (its ``config/model2tau.json``)."""

    name = "cake"
    paper = "CAKE (arXiv 2503.12491)"

    layer_budget: str = "cake"
    gamma: float = 200.0

    def summed_contributions(self, stats: AttentionStats, block_size: int | None = None) -> torch.Tensor:
        """``mean + γ·var`` over the window of each query head's contributions (block by block, merged
        with Chan's parallel variance), reduced over each KV group: ``[B,Hkv,T]``."""
        count, mean, squares = 0, 0.0, 0.0
        for block in stats.blocks(block_size):
            part = self.contributions(block)  # [B,Hq,w,T_b]: zero weight on the unseen slots
            part = F.pad(part, (0, stats.keys.shape[2] - part.shape[-1]))
            size, part_mean = part.shape[-2], part.mean(dim=-2)
            part_squares = (part - part_mean[..., None, :]).square().sum(dim=-2)
            delta, total = part_mean - mean, count + size
            mean = mean + delta * size / total
            squares = squares + part_squares + delta.square() * count * size / total
            count = total
        indicator = mean + self.gamma * squares / max(count - 1, 1)  # CAKE's indicator (mean + γ·var)
        return reduce_gqa(indicator, stats.keys.shape[1], mode=self.gqa)
