"""One forward of CAKE's cascading allocation (CAKE Alg. 1) on an :class:`~kvbench.engine.cache.EvictionCache`: what a
dynamic layer budget's :meth:`~kvbench.policies.layer_budget.LayerBudget.cascade` sees of the cache
(:class:`~kvbench.policies.layer_budget.CascadedCache`).

Each stage ranks its own layer and shrinks the earlier ones. A layer's evictions are recorded as its budget and made
once, when the forward ends (:meth:`CascadeStages.finish`): budgets only shrink from stage to stage and a layer keeps
the ranking of its own stage, so the top slots at its last budget are those the stages' successive evictions keep
(tests/test_layer_budgets.py: cascading equals evicting once to the final budgets). One selection per layer instead of
one per layer and later stage (L²/2 on a 32-layer model: 528 selections, each a handful of kernel launches on a GPU).
An attending modifier whose state merges what successive evictions hand it (SLAKE's sums, CaliDrop's attention over its
store: ``Modifier.merges_evicted``) is handed a layer's evicted entries once, then. A policy that shares a layer's
budget across its heads (AdaKV) is recorded too: its kept sets are nested in the budget (each head's safeguard grows
with it no faster than the layer's share), so its last budget's selection keeps what every stage's keeps. Where a
policy keeps whole chunks, or its scores tie by construction (LagKV: which of the tied slots stage after stage keeps is
not one top-k's choice), each stage evicts as it goes: its gathers still made once at the end, and the merging modifiers
handed what every stage dropped then (``EvictionLayer.dropped_deferred``).

Where the evictions are recorded the stages themselves are shared when the forward ends too (:attr:`defers`): each
stage's preference stays on the device until then and all are read back at once — on a GPU one synchronisation per
forward, not one per layer. The bytes each layer holds meanwhile are logged and replayed in order with the stages, so
the peak accounted is the one stage-by-stage eviction holds.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvbench.engine.layer import EvictionLayer
from kvbench.engine.selection import kept_per_head, reserved_slots, top_slots
from kvbench.engine.sharing import SharedForward
from kvbench.policies.base import Policy
from kvbench.policies.layer_budget import CascadingAllocation
from kvbench.policies.stats import AttentionStats


class StagedCache(Protocol):
    """What the stages use of the cache (:class:`~kvbench.engine.cache.EvictionCache`)."""

    policy: Policy
    prompt_len: int
    layer_budgets: list[int]
    attending: list
    merging: bool
    allocation: CascadingAllocation | None

    @property
    def eviction_layers(self) -> list[EvictionLayer]: ...

    def shared_scores(
        self, layer_idx: int, budget: int, scaling: float, shared: SharedForward | None
    ) -> torch.Tensor: ...

    def preference_stats(self, layer_idx: int, scaling: float, shared: SharedForward | None) -> AttentionStats: ...

    def evict(self, layer_idx: int, budget: int, scaling: float, defer: bool = False) -> None: ...

    def account(self, layer_idx: int, tokens: int | None = None) -> None: ...

    def hold(self, layer_idx: int, held: int) -> None: ...


class CascadeStages:
    """The stages of one forward's cascade over ``cache``; ``shared`` what the running stage ranks and scores from in a
    shared prefill (its variants' rankings and window statistics)."""

    def __init__(self, cache: StagedCache) -> None:
        self.cache = cache
        self.shared: SharedForward | None = None
        policy = cache.policy
        #: whether an eviction only records the layer's budget (see the module's docstring)
        at_once = cache.merging or not cache.attending  # what any stage drops can be handed on once the forward ends
        self.records = at_once and not (policy.keeps_ranked_only or policy.ranks_with_ties)
        #: the budget each layer is to be evicted to when the forward ends
        self.budgets: dict[int, int] = {}
        #: until then, in order: the stages deferred (a layer) and the bytes a layer came to hold (a layer, its bytes)
        self.log: list[tuple[int, int | None]] = []

    @property
    def defers(self) -> bool:
        """Whether the stages are shared when the forward ends (see the module's docstring)."""
        return self.records and all(layer.headwise is None for layer in self.cache.eviction_layers)

    @property
    def layer_budgets(self) -> list[int]:
        return self.cache.layer_budgets  # the cache's own list: a stage's slice assignment re-shares it

    def layer_size(self, layer_idx: int) -> int:
        held = self.cache.eviction_layers[layer_idx].tokens_per_head()
        return min(held, self.budgets.get(layer_idx, held))

    def rank(self, layer_idx: int, budget: int, scaling: float) -> torch.Tensor:
        """The layer's ranking ``[B,Hc,T]`` at ``budget``, kept as its ranking for :meth:`evict`."""
        layer = self.cache.eviction_layers[layer_idx]
        layer.ranking = self.cache.shared_scores(layer_idx, budget, scaling, self.shared).float()
        return layer.ranking

    def preference_stats(self, layer_idx: int, scaling: float) -> AttentionStats:
        """The attention statistics of the layer's observation window, for its preference."""
        return self.cache.preference_stats(layer_idx, scaling, self.shared)

    def evicted_by(self, layer_idx: int, budget: int, scores: torch.Tensor) -> torch.Tensor:
        """The slots ``[B,Hc,T]`` (True = evicted) that keeping ``budget`` by ``scores [B,Hc,T]`` would evict (each
        head its own share where the policy shares the layer's budget across its heads)."""
        policy, prompt_len = self.cache.policy, self.cache.prompt_len
        tokens = self.cache.eviction_layers[layer_idx].get_seq_length()
        kept = kept_per_head(policy, scores, tokens, budget, prompt_len)
        if kept is not None:
            return ~kept
        recent, sinks = reserved_slots(policy, tokens, budget, prompt_len)
        kept = top_slots(scores, budget, recent, sinks)
        return torch.ones_like(scores, dtype=torch.bool).scatter_(-1, kept, False)

    def evict(self, layer_idx: int, budget: int, scaling: float) -> None:
        """Evict the layer to ``budget`` by its stage's ranking: recorded, or made now (see the module's docstring)."""
        layer = self.cache.eviction_layers[layer_idx]
        if self.records and layer.headwise is None:
            self.budgets[layer_idx] = budget
            self.cache.account(layer_idx, budget)
        else:
            self.cache.evict(layer_idx, budget, scaling, defer=True)

    def defer(self, layer_idx: int) -> None:
        """The stage of ``layer_idx`` is shared when the forward ends (its preference kept by the allocation)."""
        self.log.append((layer_idx, None))

    def logs(self, layer_idx: int, held: int) -> bool:
        """Whether the bytes ``held`` by the layer are accounted when the deferred stages are replayed (logged)."""
        logged = bool(self.log) and self.defers
        if logged:
            self.log.append((layer_idx, held))
        return logged

    def finish(self, scaling: float) -> None:
        """Share the deferred stages in order (their preferences read back at once), make the recorded evictions,
        then gather what every eviction kept."""
        cache = self.cache
        if self.shared is not None:
            self.shared.settle()  # the last layer's preferences, before its other variants' (the forward ends here)
        if self.log:
            allocation = cache.allocation
            assert allocation is not None  # a cascade is a dynamic layer budget's
            preferences = iter(torch.stack(allocation.deferred).tolist() if allocation.deferred else [])
            log, self.log, allocation.deferred = self.log, [], []
            for layer_idx, held in log:
                if held is None:
                    cache.policy.layer_budget.share(allocation, self, layer_idx, next(preferences), scaling)
                else:
                    cache.hold(layer_idx, held)
        for layer_idx, budget in self.budgets.items():
            cache.evict(layer_idx, budget, scaling, defer=True)
        for layer in cache.eviction_layers:
            if cache.merging and (evicted := layer.dropped_deferred()) is not None:  # what every stage dropped
                for modifier in cache.attending:
                    assert layer.last_query is not None  # kept where modifiers attend (EvictionCache.after_attention)
                    modifier.on_evict(layer.state_of(modifier), evicted, layer.last_query, scaling)
            layer.gather_deferred()
