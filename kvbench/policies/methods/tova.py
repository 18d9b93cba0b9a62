"""TOVA (Oren et al., 2024, arXiv 2401.06104): evict the token the newest query attends to least."""

from dataclasses import dataclass

import torch

from kvbench.domains import choice, integer, setting
from kvbench.policies.base import Policy
from kvbench.policies.registry import register

TOVA_MODES = ("layer", "head")


@register
@dataclass
class TOVA(Policy):
    """Score ``A_last,p``: the attention of the most recent query (TOVA §3); nothing reserved but the first
    ``n_sink`` tokens (OBCache App. C.2.2 keeps 4).

    ``heads``: ``layer`` averages the last query's attention over every head of the layer and keeps the same
    tokens in all of them, as TOVA's released code (``src/tova_cache.py``: ``torch.mean(attn_weights[:, :,
    -1, :], dim=1)``, one top-k per layer) and kvpress's ``TOVAPress`` do; ``head`` lets each cache head keep
    its own tokens. Modifiers re-rank per head first; the layer average comes last.
    """

    name = "tova"
    paper = "TOVA (arXiv 2401.06104)"

    heads: str = setting(choice(*TOVA_MODES), "layer")
    n_sink: int = setting(integer(0, "a token count"), 0)

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return 1

    def reserved_sinks(self) -> int:
        return self.n_sink

    def share_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """The per-head rankings ``[B,Hc,T]`` averaged over the layer's heads in ``layer`` mode (the heads hold the
        same positions there, so slots line up)."""
        return scores.mean(dim=1, keepdim=True).expand_as(scores) if self.heads == "layer" else scores
