"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention, plus a recent window."""

from dataclasses import dataclass
from typing import Any

from kvbench.policies.base import Policy, window_tokens
from kvbench.policies.registry import register


@register
@dataclass
class H2O(Policy):
    """Score ``Σ_i A_ip`` over every query seen so far (H2O §3, eq. 2's accumulated attention).

    ``window`` recent tokens are always kept: an int, a fraction of the budget (0.5 = CaliDrop's half
    heavy / half recent) or ``'Npct'`` of the prompt (OBCache's LongBench setting).
    """

    name = "h2o"
    paper = "H2O (arXiv 2306.14048)"
    accumulates = True

    window: Any = 0.5

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        return window_tokens(self.window, budget, prompt_len)
