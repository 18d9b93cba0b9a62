"""CAKE (Qin et al., ICLR 2025, arXiv 2503.12491): attention-shift tolerant indicator, preference budgets."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kvbench.budgets import Budget
from kvbench.domains import choice, number, optional, setting
from kvbench.papers import exponents
from kvbench.policies.layer_budget import CascadingAllocation, DynamicLayerBudget, LayerBudget
from kvbench.policies.methods.snapkv import SnapKV
from kvbench.policies.registry import register
from kvbench.policies.stats import AttentionStats

#: CAKE's released preference exponents per model and average per-layer budget, (tau1, tau2)
#: (antgroup/cakekv, experiments/LongBench/config/model2tau.json; its keys llama3.1-8b-128k, llama2-7b-chat-4k,
#: llama2-13b-chat-4k, mistral-0.3-7b-32k, qwen2.5-7b-instruct; budgets 128 and 1024 only). Elsewhere the
#: released code falls back to 1.0, 1.0 (pred_cake.py). Transcribed in kvbench/papers/settings/exponents.csv.
CAKE_TAU = exponents("cake")


@register
@dataclass
class CakeBudget(DynamicLayerBudget):
    """CAKE's preference ``P = H^(1/τ1) · V^(1/τ2)`` (CAKE eq. 6): spatial dispersion H (entropy) and
    temporal shift V (variance over the window queries) of the attention to the keys before the window.
    ``tau1``/``tau2`` ``None``: CAKE's released value for the model and budget (:data:`CAKE_TAU`), else 1.0,
    the released code's default."""

    name = "cake"
    paper = "CAKE (arXiv 2503.12491)"
    reads_evicted = False  # the window's attention alone

    tau1: float | None = setting(optional(number(0, low_open=True), "CAKE's released value for the model"), None)
    tau2: float | None = setting(optional(number(0, low_open=True), "CAKE's released value for the model"), None)
    #: ``proportional``: CAKE eq. 7's shares, rounded by largest remainder (the total kept exactly);
    #: ``released``: as antgroup/cakekv rounds them (truncated, the leftover to the lowest layers; +compat=cakekv)
    rounding: str = setting(choice("proportional", "released"), "proportional")

    def for_model(self, model_id: str | None, budget: Budget) -> CakeBudget:
        released = CAKE_TAU.get(model_id or "", {}).get(budget.tokens or -1, (1.0, 1.0))
        return replace(
            self,
            tau1=released[0] if self.tau1 is None else self.tau1,
            tau2=released[1] if self.tau2 is None else self.tau2,
        )

    def allocation(self, budget: int, reserved: int, num_layers: int) -> CascadingAllocation:
        return CascadingAllocation(budget, reserved, num_layers, released=self.rounding == "released")

    def preference(self, stats: AttentionStats, evicted: torch.Tensor | None) -> torch.Tensor:
        tau1, tau2 = (1.0 if tau is None else tau for tau in (self.tau1, self.tau2))
        return stats.once(("cake", tau1, tau2), lambda: cake_preference(stats.weights, tau1, tau2))  # CAKE eq. (6)


def cake_preference(weights: torch.Tensor, tau1: float, tau2: float) -> torch.Tensor:
    """CAKE's layer preference ``P = H^(1/τ1) · V^(1/τ2)`` (0-d) from the window attention ``weights [B,Hq,W,T]``.

    Over the keys before the window (the window itself is always kept), summed over heads: spatial
    dispersion ``H = −Σ A log A`` (entropy) and temporal shift ``V = Σ_p Var_i(A_ip)`` (unbiased variance
    over the W window queries), as CAKE's released code computes them (``cake/model/modify_llama.py``).
    """
    prefix = weights[..., : weights.shape[-1] - weights.shape[-2]]  # [B,Hq,W,T-W]
    dispersion = -torch.special.xlogy(prefix, prefix).sum()
    shift = prefix.var(dim=-2).sum()
    return dispersion ** (1.0 / tau1) * shift ** (1.0 / tau2)


@register
@dataclass
class Cake(SnapKV):
    """CAKE's eviction indicator ``I_p = Mean_i(A_ip) + γ·Var_i(A_ip)`` over the observation window
    (unbiased variance over its queries), pooled like SnapKV (avg, kernel 5) with the window kept, and
    budgets from CAKE's layer preferences with cascading prefill (:class:`CakeBudget`). ``γ = 200``, window
    32 and the pooling are the defaults of CAKE's released code (``experiments/LongBench/pred_cake.py``,
    ``cake/model/modify_llama.py``). While decoding (evicting every step) the released code scores with
    the current query alone, so the variance term vanishes (one query)."""

    name = "cake"
    paper = "CAKE (arXiv 2503.12491)"

    layer_budget: LayerBudget = field(default_factory=CakeBudget)
    gamma: float = setting(number(0), 200.0)
    #: evict a prompt longer than the ``budget`` (every policy), or only one longer than ``budget_and_window``
    #: (CAKE's release: ``seq_len > cache_size + window_size``, ``cake/cake_cache.py``; +compat=cakekv)
    compress_above: str = setting(choice("budget", "budget_and_window"), "budget")

    def compresses(self, budget: int, prompt_len: int) -> bool:
        window = self.reserved_recent(budget, prompt_len) if self.compress_above == "budget_and_window" else 0
        return prompt_len > budget + window

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        """The observation window in prefill; while decoding, only the current query (CAKE's released
        ``CakeDecodingKVCache_LayerWise`` scores the mean attention of the current query, pooled)."""
        return 1 if decoding else super().scoring_window(budget, prompt_len)

    def reduce_queries(self, parts: Iterable[torch.Tensor], tokens: int) -> torch.Tensor:
        """``mean + γ·var`` over the window of each query head's contributions (block by block, merged with
        Chan's parallel variance): ``[B,Hq,T]``."""
        count = 0
        mean: torch.Tensor | float = 0.0
        squares: torch.Tensor | float = 0.0
        for part in parts:  # [B,Hq,w,T_b]: zero weight on the unseen slots
            part = F.pad(part, (0, tokens - part.shape[-1]))
            size, part_mean = part.shape[-2], part.mean(dim=-2)
            part_squares = (part - part_mean[..., None, :]).square().sum(dim=-2)
            delta, total = part_mean - mean, count + size
            mean = mean + delta * size / total
            squares = squares + part_squares + delta.square() * count * size / total
            count = total
        indicator = mean + self.gamma * squares / max(count - 1, 1)  # CAKE's indicator (mean + γ·var)
        assert isinstance(indicator, torch.Tensor)  # the stats have at least one block
        return indicator
