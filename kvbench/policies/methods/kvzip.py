"""KVzip (Kim et al., 2025, arXiv 2505.23416): keep what the model reads back when asked to repeat its context."""

from dataclasses import dataclass

import torch

from kvbench.domains import FLAG, integer, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.layer_budget import Uniform, conserve_total
from kvbench.policies.registry import register


@register
@dataclass
class KVzip(Policy):
    """A context, prefilled whole, is scored by reconstructing it: the model reads "Repeat the previous context
    exactly." and the context again, ``chunk_size`` tokens a forward, and each cached slot scores the most attention
    any repeating query of its KV group pays it (KVzip eq. 2, the ``reconstruction`` statistic; kvpress's
    ``KVzipPress``). The ``n_sink`` first slots are kept. Query-agnostic by design: it needs a context split
    (``task.query_mode=agnostic``) and runs oneshot. Unless ``layerwise``, the layers share the budget as the scores
    say (KVzip §3.3): the top ``budget × layers × heads`` slots of every layer and head together, each layer keeping
    its count over its heads (rounded, largest remainder); ``layerwise``: every layer its own budget."""

    name = "kvzip"
    paper = "KVzip (arXiv 2505.23416)"

    #: context tokens each reconstruction forward repeats (kvpress's default)
    chunk_size: int = setting(integer(1, "a token count"), 2048)
    #: first slots kept
    n_sink: int = setting(integer(0, "a token count"), 4)
    #: each layer keeps its own budget (the layer budget's), not a share of the total by the scores
    layerwise: bool = setting(FLAG, False)
    #: each cache head keeps its own share of its layer's (or, unless ``layerwise``, of every layer's) top slots, as
    #: KVzip and kvpress's ``KVzipPress`` keep them; a length per head
    headwise: bool = setting(FLAG, False)

    @property
    def statistic(self) -> Statistic:
        return "reconstruction"

    @property
    def label(self) -> str:
        return f"{self.spec}[headwise]" if self.headwise else self.spec

    def refusal(self, regime: str, query_agnostic: bool, decode_evict: bool = False) -> str | None:
        if regime != "oneshot":
            return f"policy {self.spec} reconstructs a whole prefilled context: engine.regime=oneshot, not {regime}"
        if not query_agnostic:
            return f"policy {self.spec} reconstructs a context before its question: it needs task.query_mode=agnostic"
        if self.layer_budget.dynamic or not (self.layerwise or isinstance(self.layer_budget, Uniform)):
            return (
                f"policy {self.spec} shares the budget across layers by its scores: policy.layer_budget="
                f"{self.layer_budget.name} needs policy.layerwise=true and a static layer budget"
            )
        return super().refusal(regime, query_agnostic, decode_evict)

    def reconstruction_chunk(self) -> int:
        return self.chunk_size

    def reserved_sinks(self) -> int:
        return self.n_sink

    def score(self, context: ScoreContext) -> torch.Tensor:
        assert context.summed is not None  # the reconstruction statistic
        return context.summed

    def layer_shares(self, rankings: list[torch.Tensor], budgets: list[int]) -> list[int]:
        if self.layerwise:
            return budgets
        counts = kept_counts(rankings, sum(budgets) * rankings[0].shape[1], self.n_sink)
        return conserve_total(counts, sum(budgets), caps=[ranking.shape[-1] for ranking in rankings])

    def head_budgets(self, rankings: list[torch.Tensor], budgets: list[int]) -> list[torch.Tensor] | None:
        if not self.headwise:
            return None
        heads = rankings[0].shape[1]
        if self.layerwise:
            return [
                kept_by_head([ranking], budget * heads, self.n_sink)[0] for ranking, budget in zip(rankings, budgets)
            ]
        return kept_by_head(rankings, sum(budgets) * heads, self.n_sink)


def kept_by_head(rankings: list[torch.Tensor], kept: int, sinks: int) -> list[torch.Tensor]:
    """How many of the top ``kept`` slots of every layer's ranking ``[1,Hc,T_l]`` together each cache head of each
    layer holds ``[1,Hc]``, the first ``sinks`` of each head above every slot (kvpress ``KVzipPress.compress_post``)."""
    scores = [ranking.float().clone() for ranking in rankings]
    for layer in scores:
        layer[..., :sinks] = torch.inf
    flat = torch.cat([layer.flatten() for layer in scores])
    heads = [layer.shape[1] for layer in scores]
    owner = torch.cat(
        [
            torch.arange(layer.shape[1]).repeat_interleave(layer.shape[2]) + sum(heads[:index])
            for index, layer in enumerate(scores)
        ]
    ).to(flat.device)  # each slot's (layer, head)
    top = flat.topk(min(kept, flat.numel())).indices
    counts = torch.bincount(owner[top], minlength=sum(heads))
    return [part[None] for part in counts.split(heads)]


def kept_counts(rankings: list[torch.Tensor], kept: int, sinks: int) -> list[int]:
    """How many of the top ``kept`` slots of every layer's ranking ``[1,Hc,T_l]`` together each layer holds over its
    heads (:func:`kept_by_head`)."""
    return [int(counts.sum()) for counts in kept_by_head(rankings, kept, sinks)]
