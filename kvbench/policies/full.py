"""Full cache: never evicts (the reference every policy is compared with)."""

from dataclasses import dataclass

from kvbench.policies.base import Policy
from kvbench.policies.registry import register


@register
@dataclass
class Full(Policy):
    """Keep every token."""

    name = "full"
    paper = "—"
    evicts = False
    needs_attention = False
