"""What a budgeted cache ranks its layers' slots from (:class:`Scorer`): the statistic its policy declares, gathered
for one layer and budget, shared by the variants of one shared prefill where they read the same (rankings by
:meth:`Scorer.ranking_key`, window statistics by size), and the running sums each scored forward adds; and what the
engine declared of the forward under way (:class:`Forward`). The store of entries is :mod:`kvbench.engine.layer`, the
selection :mod:`kvbench.engine.selection`, the cache that evicts by them :mod:`kvbench.engine.cache`."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from kvbench.engine import attention
from kvbench.engine.layer import EvictionLayer
from kvbench.engine.sharing import SharedForward
from kvbench.policies import channel_pruner
from kvbench.policies.base import AttentionStats, Policy
from kvbench.policies.context import LayerWeights, ScoreContext
from kvbench.policies.layer_budget import CascadingAllocation
from kvbench.policies.parts import settings_key
from kvbench.policies.stats import NormalisedStats, memoised


@dataclass(frozen=True)
class Forward:
    """A forward as the engine declared it (:meth:`~kvbench.engine.cache.EvictionCache.begin_forward`)."""

    positions: torch.Tensor  # [q]: its tokens' absolute positions
    evict: bool  # it evicts after it
    scored: bool  # its queries are added to a running score: it evicts, or later forwards do
    decoding: bool  # it generates (after the prompt) rather than prefills
    seen: int  # the tokens declared up to and with it
    #: no forward after it evicts: what only an eviction reads is let go once it has evicted
    last_eviction: bool


def uses_normaliser(policy: Policy) -> bool:
    """Whether the cache adds a running policy's sums in one pass per forward, each weight from its query's
    normaliser beside the backend's attention output (``kvbench.policies.stats``: no second attention, no
    float32 softmax), rather than from float32 attention weights: where the policy scores causally (every
    re-weighting modifier gives the same sums from such a pass, :meth:`Modifier.contribution_sums`)."""
    return policy.running and policy.scores_causally


def sums_key(policy: Policy) -> str | None:
    """Variants with the same key add the same normalised sums of a forward to their running scores: ``policy``'s
    settings (not its budget, nor how its layers share it) and its re-weighting modifier (CAOTE, CaliDrop or SLAKE
    over H2O add H2O's), where the cache sums from the normaliser (:func:`uses_normaliser`);
    None elsewhere."""
    return statistic_key(policy) if uses_normaliser(policy) else None


def statistic_key(policy: Policy) -> str:
    """What ``policy``'s statistic and base score depend on of its settings: the base's (not how its layers share the
    budget) and its re-weighting modifier's (OBCache changes the statistic itself)."""
    reweighting = [] if policy.reweighting is None else [policy.reweighting]
    return settings_key(policy, *reweighting, without=("layer_budget",))


class Scorer:
    """A cache's ranking of its ``layers`` for its ``policy`` (``prompt_len`` the prompt's tokens; ``score_block`` the
    queries a blocked pass takes at once; ``sums_kernel`` the running sums' pass; ``layer_weights`` what a score may
    read of each layer's weights; ``allocation`` a dynamic layer budget's cascade, or None)."""

    def __init__(
        self,
        policy: Policy,
        layers: list[EvictionLayer],
        prompt_len: int,
        score_block: int | None,
        sums_kernel: str,
        layer_weights: list[LayerWeights] | None,
        allocation: CascadingAllocation | None,
    ) -> None:
        self.policy, self.layers, self.prompt_len = policy, layers, prompt_len
        self.score_block, self.sums_kernel = score_block, sums_kernel
        self.layer_weights, self.allocation = layer_weights, allocation
        #: the modifier that prunes the prompt's key channels once it is read (ThinK), or None
        self.pruner = channel_pruner(policy)

    # -- running sums ------------------------------------------------------------------------------------
    def wants_normaliser(self, forward: Forward) -> bool:
        """Whether ``forward`` adds the fused pass's running sums (``engine.sums_kernel=triton``), which read each
        query's log-sum-exp: the attention then gives it with its output (:func:`~kvbench.engine.attention.
        cache_attention`) rather than a second call."""
        return self.sums_kernel == "triton" and forward.scored and uses_normaliser(self.policy)

    def normalised_sums(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        outputs: torch.Tensor,
        scaling: float,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The policy's sums ``[B,Hc,T]`` of ``queries [B,Hq,q,D]`` over ``keys``/``values [B,Hc,T,D]`` with their
        attention ``outputs [B,q,Hq,D]``, each weight from its query's normaliser: a fused kernel's on
        ``NORMALISER_KERNEL_DEVICES`` (and for ``engine.sums_kernel=triton``, whose one pass then gives the sums;
        ``lse [B,Hq,q]`` where the attention gave it with its output), else each block's own
        (``kvbench.policies.stats``)."""
        fused = self.sums_kernel == "triton"
        transposed = outputs.transpose(1, 2).contiguous()
        stats = NormalisedStats(queries, keys, values, scaling, transposed, lse, fused=fused)
        if lse is None and (fused or queries.device.type in attention.NORMALISER_KERNEL_DEVICES):
            stats.lse = attention.attention_with_lse(queries, keys, values, scaling)[1]
        return self.policy.normalised_sums(stats, self.score_block)

    def add_running(
        self,
        layer: EvictionLayer,
        forward: Forward,
        queries: torch.Tensor,
        outputs: torch.Tensor,
        scaling: float,
        budget: int,
        lse: torch.Tensor | None,
        summed: torch.Tensor | None,
    ) -> None:
        """Add ``forward``'s sums (``summed`` where a variant with the same sums computed them) to the layer's running
        score."""
        assert layer.running_score is not None and layer.positions is not None  # made by a scored forward's update
        if uses_normaliser(self.policy):
            if summed is None:
                summed = self.normalised_sums(queries, layer.keys, layer.values, outputs, scaling, lse)
            layer.running_score += summed
            return
        seen = self.policy.scoring_positions(forward.positions.to(queries.device), budget, self.prompt_len)
        stats = AttentionStats(queries, layer.keys, layer.values, seen, layer.positions, scaling)
        layer.running_score += self.policy.summed_contributions(stats, self.score_block)

    # -- windows -----------------------------------------------------------------------------------------
    def query_window(self, budget: int) -> int:
        """How many recent queries a layer keeps: the scoring window, the preference window with a dynamic layer
        budget, and those a channel pruner reads."""
        policy = self.policy
        window = 0 if self.pruner is None else self.pruner.channel_queries()
        if policy.statistic in ("window", "queries"):
            window = max(window, policy.scoring_window(budget, self.prompt_len))
        if self.allocation is not None:
            window = max(window, self.preference_window())
        return window

    def preference_window(self) -> int:
        """The observation window of a dynamic layer budget's preference, at the average budget."""
        assert self.allocation is not None  # only with a dynamic layer budget
        policy = self.policy
        return policy.layer_budget.observation_window(policy.scoring_window(self.allocation.budget, self.prompt_len))

    def window(self, layer_idx: int, size: int, scaling: float, shared: SharedForward | None) -> AttentionStats:
        """The layer's statistics of its last ``size`` queries: one per layer and size for a shared prefill's variants
        (``shared``; its tensors computed once, lazily)."""
        if shared is None:
            return self.layers[layer_idx].window_stats(size, scaling)
        assert shared.layer == layer_idx  # a layer's own statistics
        if size not in shared.windows:
            shared.windows[size] = stats = self.layers[layer_idx].window_stats(size, scaling)
            stats.batched = True  # what the variants ask together is computed when the layer ends (SharedForward)
        return shared.windows[size]

    # -- rankings ----------------------------------------------------------------------------------------
    def ranking_key(self, budget: int, forward: Forward) -> tuple | None:
        """What a layer's ranking for ``budget`` depends on beyond its entries and statistics (one shared prefill's):
        what the policy ranks by (:attr:`~kvbench.policies.base.Policy.ranking_key`) and the windows it reads; None
        where it also reads the budget (:attr:`~kvbench.policies.base.Policy.ranking_reads_budget`) or budget-dependent
        running sums (not from the normaliser). (A cascading layer budget's stage ranks its layer in full, at the
        average budget, like any variant's eviction.)"""
        return self._shared_key(self.policy.ranking_key, self.policy.ranking_reads_budget, budget, forward)

    def shared_scores(
        self, layer_idx: int, budget: int, scaling: float, shared: SharedForward | None, forward: Forward
    ) -> torch.Tensor:
        """:meth:`scores`, taken from (or put in) ``shared`` under :meth:`ranking_key`."""
        key = None if shared is None else self.ranking_key(budget, forward)
        if shared is None or key is None:
            return self.scores(layer_idx, budget, scaling, shared, forward)
        assert shared.layer == layer_idx  # a layer's own ranking
        if key not in shared.rankings:
            shared.rankings[key] = self.scores(layer_idx, budget, scaling, shared, forward)
        return shared.rankings[key]  # read, never written: a layer keeps its ranking gathered at the slots it keeps

    def score_key(self, budget: int, forward: Forward) -> tuple | None:
        """What a layer's base score (:meth:`~kvbench.policies.base.Policy.score`, before a modifier re-ranks it)
        depends on beyond one shared prefill's entries and statistics: :meth:`ranking_key`'s but for the re-ranking
        modifiers (a modifier changes the base's score only by re-weighting its statistic), so that one base's
        variants (alone, under ChunkKV, CriticalKV or CAOTE, at any budget) score it once; None where the base reads
        the budget or budget-dependent running sums."""
        return self._shared_key(("score", statistic_key(self.policy)), self.policy.reads_budget, budget, forward)

    def _shared_key(self, identity: Hashable, reads_budget: bool, budget: int, forward: Forward) -> tuple | None:
        """``identity`` with the reserved window, the scoring window and the sinks at ``budget``: a key under which a
        shared prefill's variants share what they rank by; None where it reads the budget (``reads_budget``) or
        budget-dependent running sums (not from the normaliser)."""
        policy = self.policy
        if reads_budget or (policy.running and not uses_normaliser(policy)):
            return None
        recent = min(policy.reserved_recent(budget, self.prompt_len), budget)
        window = policy.scoring_window(budget, self.prompt_len, forward.decoding)
        return identity, recent, window, policy.reserved_sinks()

    def scores(
        self, layer_idx: int, budget: int, scaling: float, shared: SharedForward | None, forward: Forward
    ) -> torch.Tensor:
        """The policy's ranking of every cached slot ``[B,Hc,T]`` (before reserving) for ``budget``, from the
        statistic it declares (:attr:`~kvbench.policies.base.Policy.statistic`); in a shared prefill from the base
        score its variants share (:meth:`score_key`)."""
        key = None if shared is None else self.score_key(budget, forward)
        if shared is None or key is None:
            return self.policy.ranking(self.context(layer_idx, budget, forward, scaling, shared))

        def score() -> torch.Tensor:  # read, never written, by every variant of the key
            return self.policy.score(self.context(layer_idx, budget, forward, scaling, shared))

        base = memoised(shared.entries, key, score)
        return self.policy.ranking(self.context(layer_idx, budget, forward, scaling, shared, key), base)

    def context(
        self,
        layer_idx: int,
        budget: int,
        forward: Forward,
        scaling: float = 1.0,
        shared: SharedForward | None = None,
        score_key: Hashable | None = None,
    ) -> ScoreContext:
        """What the policy ranks the layer's slots from for ``budget`` (its declared statistic gathered; with
        ``score_key``, the key of the base score its shared prefill shares, not summed: only the modifiers read it)."""
        policy, layer = self.policy, self.layers[layer_idx]
        assert layer.positions is not None
        summed, window = None, None
        if policy.statistic in ("window", "queries"):
            size = policy.scoring_window(budget, self.prompt_len, forward.decoding)
            window = self.window(layer_idx, size, scaling, shared)
            if policy.statistic == "window" and score_key is None:
                summed = policy.summed_contributions(window, self.score_block)
        elif policy.running:
            assert layer.running_score is not None  # running policies evict only after scored forwards
            summed = layer.running_score
        elif policy.statistic == "reconstruction":
            summed = layer.received
        recent = min(policy.reserved_recent(budget, self.prompt_len), budget)
        weights = None if self.layer_weights is None else self.layer_weights[layer_idx]
        sinks = policy.reserved_sinks()
        return ScoreContext(
            layer.keys,
            layer.values,
            layer.positions,
            summed,
            recent,
            window,
            weights,
            sinks,
            budget,
            None if shared is None else shared.entries,
            forward.seen,
            layer_idx,
            score_key,
        )
