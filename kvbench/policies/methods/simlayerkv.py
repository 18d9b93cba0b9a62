"""SimLayerKV (Zhang et al., 2024, arXiv 2410.13846): a lazy layer keeps its first and most recent tokens, the
others keep everything."""

from dataclasses import dataclass

import torch

from kvbench.domains import choice, integer, number, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, evicting_again
from kvbench.policies.registry import register


@register
@dataclass
class SimLayerKV(Policy):
    """A layer is *lazy* where its last ``n_last`` queries, averaged over the batch, the query heads and those
    queries, put more than ``lazy_threshold`` of their attention on the first ``n_initial`` keys and the
    ``budget − n_initial + n_last`` keys before themselves (SimLayerKV §3.2, as kvpress's ``SimLayerKVPress``
    tests it: the queries' own keys left out of the sum). A lazy layer keeps its ``n_initial`` first tokens and its
    most recent ``budget − n_initial`` (the budget in all); every other layer keeps the whole prompt, so the cache
    holds between the budget and the prompt per layer (the records say how much). One decision per layer over
    the batch, as kvpress; ``lazy_threshold`` 0.9 is the paper's value for Llama 3 (kvpress lists 0.65 for Llama 2,
    0.8 Mistral, 0.85 Qwen; its default 1.0 never evicts)."""

    name = "simlayerkv"
    paper = "SimLayerKV (arXiv 2410.13846)"
    swept = False  # the leaderboard's cells not run yet
    bounded = False  # a layer that is not lazy keeps the prompt
    reads_budget = True  # the lazy test's recent span is the budget's window

    lazy_threshold: float = setting(number(0, 1), 0.9)
    n_last: int = setting(integer(1, "a query count"), 1)
    n_initial: int = setting(integer(0, "a token count"), 4)
    #: evict a prompt longer than the budget (every policy), or only one longer than ``budget + 2·n_last`` (kvpress's
    #: minimum ``n_initial + n_recent + n_last``)
    compress_above: str = setting(choice("budget", "kvpress"), "budget")

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return self.n_last

    def reserved_sinks(self) -> int:
        return self.n_initial

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        return max(budget - self.n_initial, 0)

    def compresses(self, budget: int, prompt_len: int) -> bool:
        return prompt_len > budget + (2 * self.n_last if self.compress_above == "kvpress" else 0)

    @property
    def keeps_ranked_only(self) -> bool:
        return True  # a lazy layer ranks none of its middle slots, another every one

    def budget_refusal(self, budget: int, prompt_len: int) -> str | None:
        """A lazy layer's kept set is its sinks and window (nothing ranked): refused only where no window is left."""
        if budget <= self.n_initial and self.compresses(budget, prompt_len):
            return (
                f"policy {self.spec} keeps policy.n_initial={self.n_initial} first tokens and a recent window of the "
                f"{budget}-token budget in a lazy layer: valid choices: a budget above {self.n_initial}"
            )
        return None

    def refusal(self, regime: str, query_agnostic: bool, decode_evict: bool = False) -> str | None:
        if (how := evicting_again(regime, decode_evict)) is not None:
            return f"policy {self.spec} tests each layer once, after the prompt: {how} evicts again"
        if others := [modifier.name for modifier in self.modifiers if not modifier.channel_queries()]:
            return (
                f"policy {self.spec}: simlayerkv keeps a layer's sinks and window or all of it, ranking no slot for "
                f"{', '.join(others)}; valid choices: simlayerkv, simlayerkv+think"
            )
        return super().refusal(regime, query_agnostic, decode_evict)

    def score(self, context: ScoreContext) -> torch.Tensor:
        """``-inf`` on every slot of a lazy layer (its sinks and window kept besides), 0 on every slot of another."""
        assert context.window is not None  # the window statistic
        attention = context.window.weights.float().mean(dim=(0, 1, 2))  # [T]: over batch, query heads, queries
        end = attention.shape[-1] - self.n_last  # the queries' own keys are left out
        recent = attention[max(end - context.recent - self.n_last, self.n_initial) : end].sum()  # not the sinks again
        lazy = bool(attention[: self.n_initial].sum() + recent > self.lazy_threshold)
        return torch.full_like(context.positions, -torch.inf if lazy else 0.0, dtype=torch.float32)
