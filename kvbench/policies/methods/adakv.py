"""AdaKV (Feng et al., 2024, arXiv 2407.11550): the cache heads of a layer share its budget by one top-k over all
their slots, each head kept at least a safeguard share; the cache then holds a different length per head."""

from dataclasses import dataclass

import torch

from kvbench.domains import number, setting
from kvbench.policies.base import Modifier, Policy
from kvbench.policies.context import evicting_again
from kvbench.policies.registry import register


@register
@dataclass
class AdaKV(Modifier):
    """Any scoring base made head-wise (AdaKV Alg. 1, kvpress's ``AdaKVPress``): each head keeps its reserved sinks and
    recent window and its ``alpha_safeguard × budget`` best slots (the reserved counted in, as kvpress's
    ``int(n_kept·alpha)``); the rest of the layer's ``budget × Hc`` goes to the best-scored remaining slots of any
    head. The layer's total is its layer budget's × heads: PyramidKV's, or CAKE's and VABS's as they cascade (a layer
    shrunk again shares its new total across its heads from the entries they hold, which keeps what sharing the new
    total from the start would: AdaKV's kept sets are nested in the budget)."""

    name = "adakv"
    paper = "AdaKV (arXiv 2407.11550)"
    shares_heads = True
    needs_attention = False

    #: each head keeps at least this share of the uniform budget
    alpha_safeguard: float = setting(number(0.0, 1.0), 0.2)

    def head_shares(self, scores: torch.Tensor, budget: int, reserved: int) -> torch.Tensor:
        batch, heads, tokens = scores.shape
        chosen = budget - reserved
        safe_total = max(int(budget * self.alpha_safeguard), int(self.alpha_safeguard > 0))  # kvpress: at least 1
        safe = min(max(safe_total - reserved, 0), chosen)
        ranked = scores.float().scatter(-1, scores.float().topk(safe, dim=-1).indices, torch.inf)  # safeguard first
        top = ranked.flatten(1).topk(heads * chosen, dim=-1).indices  # [B,Hc·chosen]: one top-k over the layer
        return torch.zeros(batch, heads, dtype=torch.long, device=scores.device).scatter_add_(
            1, top // tokens, torch.ones_like(top)
        )

    def refusal(self, policy: Policy, regime: str, query_agnostic: bool, decode_evict: bool) -> str | None:
        if (how := evicting_again(regime, decode_evict)) is not None:
            return f"policy {policy.spec} evicts once, after the prompt, to a length per head: {how} evicts again"
        attending = [modifier.name for modifier in policy.modifiers if modifier.attends]
        if attending:
            return f"policy {policy.spec}: {', '.join(attending)} attends to equal-length heads, not a length per head"
        return None
