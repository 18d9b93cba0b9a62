"""KNorm (Devoto et al., 2024, arXiv 2406.11430): keep the keys of lowest L2 norm."""

from dataclasses import dataclass

import torch

from kvbench.domains import integer, optional, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.registry import register


@register
@dataclass
class KNorm(Policy):
    """Score ``−‖k_p‖₂`` per cache head: a low key norm goes with high attention (KNorm §3), so no attention is
    read; nothing reserved, as kvpress's ``KnormPress`` (``score = -keys.norm(dim=-1)``)."""

    name = "knorm"
    paper = "KNorm (arXiv 2406.11430)"

    #: significant bits the norm is rounded to: keys of equal norm in exact arithmetic (a token repeated in the
    #: first layer; RoPE keeps norms) then tie however a batch of rows rounded them, so a row keeps what it keeps
    #: alone; null: the float32 norm as computed, kvpress's convention (its kept sets exactly)
    norm_bits: int | None = setting(optional(integer(1, "a bit count"), "the float32 norm, as kvpress"), 16)

    @property
    def statistic(self) -> Statistic:
        return "entries"

    def score(self, context: ScoreContext) -> torch.Tensor:
        norms = torch.linalg.vector_norm(context.keys.float(), dim=-1)  # [B,Hc,T]
        if self.norm_bits is None:
            return -norms
        mantissa, exponent = torch.frexp(norms)
        return -torch.ldexp(torch.round(mantissa * 2.0**self.norm_bits) / 2.0**self.norm_bits, exponent)
