"""CriticalKV (Feng et al., 2025, arXiv 2502.03805): a base's ranking, its second stage re-weighted by how much each
value moves the layer's output through the output projection."""

from dataclasses import dataclass

import torch

from kvbench.domains import choice, number, setting
from kvbench.errors import KVBenchError
from kvbench.policies.base import COUNTINGS, Modifier
from kvbench.policies.context import ScoreContext
from kvbench.policies.registry import register

#: tokens per block of the ``‖v·W_O‖₁`` projection (bounds its ``[B,Hq,T,hidden]`` working set)
PROJECTION_BLOCK = 1024


def projected_norms(values: torch.Tensor, output_per_head: torch.Tensor) -> torch.Tensor:
    """``mean_{h∈group(c)} ‖v_{c,p} · W_O[h]‖₁`` per cache head and slot (CriticalKV eq. 9's output perturbation
    bound): ``values [B,Hc,T,D]``, ``output_per_head [Hq,D,hidden]`` → ``[B,Hc,T]``."""
    heads = values.shape[1]
    weights = output_per_head.float().unflatten(0, (heads, -1))  # [Hc,G,D,hidden]
    blocks = [
        torch.einsum("bctd,cgdh->bcgth", block, weights).abs().sum(dim=-1).mean(dim=2)  # [B,Hc,t]
        for block in values.float().split(PROJECTION_BLOCK, dim=2)
    ]
    return torch.cat(blocks, dim=-1)


@register
@dataclass
class CriticalKV(Modifier):
    """Two stages over the slots the budget leaves to choose (CriticalKV Alg. 1): the base's top
    ``first_stage_ratio`` of them are kept first, the rest ranked by ``(s_p + ε)·‖v_p·W_O‖₁`` (averaged over each KV
    group), as kvpress's ``CriticalKVPress``. Any base that scores (attention or cached entries). ``counting``:
    ``selectable`` counts the first stage over the slots the base leaves to choose (CriticalKV Alg. 1 over the
    budget after SnapKV's window); ``kvpress`` over every kept slot, the base's reserved ones first
    (criticalkv_press.py at 8bb29b9: ``int(kept · first_stage_ratio)`` of all slots, SnapKV's window scored above
    all), and ε on the scale of kvpress's window scores (a mean over the window's queries, kvbench's a sum)."""

    name = "criticalkv"
    paper = "CriticalKV (arXiv 2502.03805)"
    transforms = True
    needs_attention = False
    reads_budget = True  # the first stage keeps a share of the budget

    #: share of the selectable kept slots chosen by the base's score alone
    first_stage_ratio: float = setting(number(0.0, 1.0), 0.5)
    #: added to the base's score before the projected norm
    epsilon: float = setting(number(0.0), 1e-4)
    counting: str = setting(choice(*COUNTINGS), "selectable")

    def transform(self, scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        if context.weights is None:
            raise KVBenchError(f"{self.name} needs the layer's output projection (a Llama-style o_proj)")
        tokens = scores.shape[-1]
        selectable = scores[..., context.sinks : tokens - context.recent]
        reserved = context.sinks + context.recent
        if self.counting == "kvpress":  # of every kept slot, the reserved first (kvpress: (1 - ratio) · T · share)
            first = int((1 - (1 - context.budget / tokens)) * tokens * self.first_stage_ratio) - reserved
        else:
            first = int((context.budget - reserved) * self.first_stage_ratio)
        weights = context.weights
        norms = context.once("projected_norms", lambda: projected_norms(context.values, weights.output_per_head()))
        epsilon = self.epsilon
        if self.counting == "kvpress" and context.window is not None:  # kvpress's window scores are means over its
            epsilon *= context.window.queries.shape[-2]  # queries, kvbench's sums: ε on the same scale
        reweighted = (scores + epsilon) * norms
        chosen = selectable.topk(max(0, min(first, selectable.shape[-1])), dim=-1).indices + context.sinks
        return reweighted.scatter(-1, chosen, torch.finfo(reweighted.dtype).max)
