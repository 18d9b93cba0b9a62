"""The full cache: the reference every policy is compared with."""

from dataclasses import dataclass

from kvbench.policies.base import Policy
from kvbench.policies.context import Statistic
from kvbench.policies.registry import register


@register
@dataclass
class Full(Policy):
    """The full cache: keeps every token (the reference every policy is compared with, and what the engine runs
    where the budget holds the whole prompt)."""

    name = "full"
    paper = "—"
    evicts = False

    @property
    def statistic(self) -> Statistic:
        return "positions"
