"""Quest (Tang et al., 2024, arXiv 2406.10774): the cache kept whole; each decoded token's query reads, per head, only
the pages of keys whose upper bound on its attention logit ranks first — the bound from each page's channel-wise
minimum and maximum keys."""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.domains import integer, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import Statistic
from kvbench.policies.registry import register


def page_bounds(query: torch.Tensor, keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each query head's bound ``[B,Hq,P]`` on its logit over each page of ``page_size`` slots of ``keys [B,Hc,T,D]``
    (the last page may be short), ``query [B,Hq,1,D]``: ``Σ_d |q_d| · max_page(sign(q_d) k_d)`` (Quest §3.2, as the
    released evaluation computes it: the keys' signs by the query's, zero counted negative), in float32."""
    batch, heads, tokens, dim = keys.shape
    group = query.shape[1] // heads
    sign = torch.where(query[:, :, 0] > 0, 1.0, -1.0).view(batch, heads, group, 1, dim)  # [B,Hc,G,1,D]
    signed = keys.float()[:, :, None] * sign  # [B,Hc,G,T,D]
    pages = math.ceil(tokens / page_size)
    padded = torch.nn.functional.pad(signed, (0, 0, 0, pages * page_size - tokens), value=-torch.inf)
    highest = padded.view(batch, heads, group, pages, page_size, dim).amax(dim=-2)  # [B,Hc,G,P,D]
    magnitude = (query[:, :, 0].float().abs()).view(batch, heads, group, 1, dim)
    return (highest @ magnitude.transpose(-1, -2))[..., 0].view(batch, heads * group, pages)


@register
@dataclass
class Quest(Policy):
    """Every token kept; at each decode step each query head reads the ``max(3, budget // page_size)`` pages (of
    ``page_size`` slots from the first) whose bound (:func:`page_bounds`) is highest, all of them where there are no
    more; the first ``dense_layers`` layers read every slot, as the released evaluation runs Llama. The prompt and
    any forward of several tokens attend in full; a budget that holds the prompt runs the full cache (as for every
    policy: the released code would read ``budget // page_size`` pages from the first step). Reads, not memory: the
    cache holds the full cache's bytes; the records' ``policy_stats.read_share`` is the share of the held slots the
    decode steps read."""

    name = "quest"
    paper = "Quest (arXiv 2406.10774)"
    evicts = False
    reads = True
    swept: ClassVar[bool] = False  # not on the token leaderboard: its cells are +experiment=leaderboard_bytes's

    #: slots per page (the paper's and the released code's ``chunk_size``)
    page_size: int = setting(integer(1, "a token count"), 16)
    #: the first layers, which read every slot (the released evaluation's ``layer_id < 2``)
    dense_layers: int = setting(integer(0, "a layer count"), 2)

    @property
    def statistic(self) -> Statistic:
        return "positions"

    def read(self, query: torch.Tensor, keys: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor | None:
        if layer_idx < self.dense_layers:
            return None
        bounds = page_bounds(query, keys, self.page_size)  # [B,Hq,P]
        pages = bounds.shape[-1]
        chosen = bounds.topk(min(max(3, min(budget, keys.shape[2]) // self.page_size), pages), dim=-1).indices
        read = torch.zeros_like(bounds, dtype=torch.bool).scatter_(-1, chosen, True)  # [B,Hq,P]
        return read.repeat_interleave(self.page_size, dim=-1)[..., : keys.shape[2]]  # [B,Hq,T]
