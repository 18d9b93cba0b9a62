"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention, plus a recent window."""

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.domains import FLAG, integer, optional, setting, token_window, window_tokens
from kvbench.policies.base import Policy
from kvbench.policies.context import Statistic
from kvbench.policies.registry import register


@register
@dataclass
class H2O(Policy):
    """Score ``Σ_i A_ip`` over every query seen so far (H2O §3, eq. 2's accumulated attention), or over the
    last ``score_window`` queries only: "SnapKV's version of H2O" that OBCache App. C.2.1 runs in prefill,
    which then keeps exactly what ``snapkv`` with ``pool=none`` and the same window keeps.

    ``window`` recent tokens and the first ``n_sink`` tokens are always kept. Windows are an int, a fraction
    of the budget (0.5 = CaliDrop's half heavy / half recent) or ``'Npct'`` of the prompt.
    """

    name = "h2o"
    paper = "H2O (arXiv 2306.14048)"

    window: Any = setting(token_window(0), 0.5)
    #: queries whose attention is summed: null = every query seen (H2O), else the most recent ones
    score_window: Any = setting(optional(token_window(1), "every query seen"), None)
    #: attention sinks kept besides the heavy hitters (OBCache App. C.2.2 keeps 4 in every method)
    n_sink: int = setting(integer(0, "a token count"), 0)
    #: false: KVCache-Factory's H2O before its commit 9f9aa2e ("Fix H2O causal masking", 2026-06-22), whose
    #: score masked only the last ``window`` × ``window`` block of the prompt's attention, so every earlier
    #: query also weighed the keys after it; H2O rows produced with KVCache-Factory before then (papers of
    #: 2024–25 that took their baselines from it) ran this score. The attention itself stays causal.
    causal: bool = setting(FLAG, True)

    @property
    def statistic(self) -> Statistic:
        """``running`` (every query seen), or ``window`` with a ``score_window``."""
        return "running" if self.score_window is None else "window"

    @property
    def scores_causally(self) -> bool:
        return self.causal

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return 1 if self.score_window is None else max(1, window_tokens(self.score_window, budget, prompt_len))

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        return window_tokens(self.window, budget, prompt_len)

    def reserved_sinks(self) -> int:
        return self.n_sink

    def scoring_positions(self, query_positions: torch.Tensor, budget: int, prompt_len: int) -> torch.Tensor:
        """Non-causal (``causal=false``): the queries before the last ``window`` of the forward see every key."""
        if self.causal:
            return query_positions
        before = max(0, query_positions.shape[0] - self.reserved_recent(budget, prompt_len))
        return torch.cat([query_positions[-1:].expand(before), query_positions[before:]])
