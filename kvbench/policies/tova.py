"""TOVA (Oren et al., 2024, arXiv 2401.06104): evict the token the newest query attends to least."""

from dataclasses import dataclass

from kvbench.policies.base import Policy
from kvbench.policies.registry import register


@register
@dataclass
class TOVA(Policy):
    """Score ``A_last,p``: the attention of the most recent query (TOVA §3); nothing reserved."""

    name = "tova"
    paper = "TOVA (arXiv 2401.06104)"

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return 1
