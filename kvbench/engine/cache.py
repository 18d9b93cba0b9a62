"""A budgeted KV cache on transformers' ``Cache`` API.

Every layer stores, per cache head, the kept keys/values and their absolute token positions; eviction gathers the
kept entries into smaller tensors, so memory really shrinks. A head is ordered by position (kept indices sorted, new
tokens appended): its most recent ``r`` tokens are its last ``r`` slots.

Attending modifiers (CaliDrop, SLAKE) get every evicted entry through ``Modifier.on_evict`` and may replace
single-query attention through ``Modifier.attend``; each keeps its state in the layer's ``modifier_state[name]``.
Dynamic layer budgets (``cake``, ``vabs``) are allocated in CAKE's cascading manner while the first evicting forward
passes through the layers: the strategy drives each stage (:meth:`~kvbench.policies.layer_budget.LayerBudget.cascade`)
through the cache's ranking, eviction and window statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, cast

import torch
from transformers.cache_utils import Cache

from kvbench.engine.cascade import CascadeStages
from kvbench.engine.kivi import Kivi
from kvbench.engine.layer import EvictionLayer, in_cache_heads
from kvbench.engine.scoring import Forward, Scorer
from kvbench.engine.selection import kept_per_head, ranked_budget, reserved_slots, top_slots
from kvbench.engine.sharing import SharedForward
from kvbench.engine.sizes import CacheSizes
from kvbench.policies.base import AttentionStats, Policy
from kvbench.policies.context import LayerWeights
from kvbench.policies.layer_budget import CascadingAllocation
from kvbench.policies.stats import reconstruction_attention


class EvictionCache(Cache):
    """A ``Cache`` whose layers are evicted to per-layer budgets by a ``Policy``.

    The engine calls :meth:`begin_forward` before each model forward with the absolute positions of the new tokens
    and whether this forward evicts; the kvbench attention function calls :meth:`update` (through the model),
    :meth:`attend` for single-query forwards and then :meth:`after_attention`, where scores are gathered and layers
    evicted. With a dynamic ``policy.layer_budget`` the ``layer_budgets`` given (uniform) are the average,
    re-allocated during the first evicting forward. ``layer_weights``: each layer's weights that a score may read
    (:class:`~kvbench.policies.base.ScoreContext`)."""

    def __init__(
        self,
        policy: Policy,
        layer_budgets: list[int],
        prompt_len: int,
        num_query_heads: int,
        num_kv_heads: int,
        attn_backend: str = "sdpa",
        score_block: int | None = None,
        decode_evict: bool = False,
        layer_weights: list[LayerWeights] | None = None,
        sums_kernel: str = "torch",
        windows: list[int | None] | None = None,
        learned_sinks: bool = False,
        quant: Kivi | None = None,
    ) -> None:
        super().__init__(layers=[EvictionLayer() for _ in layer_budgets])
        self.policy = policy
        self.layer_budgets = list(layer_budgets)
        self.prompt_len = prompt_len
        self.num_query_heads = num_query_heads
        self.repeat_layout = policy.gqa == "repeat"
        self.cache_heads = num_query_heads if self.repeat_layout else num_kv_heads
        self.attn_backend = attn_backend
        self.attending = [modifier for modifier in policy.modifiers if modifier.attends]
        #: a cascade's deferred evictions hand them what they drop once it ends (CascadeStages.finish): they merge it
        self.merging = bool(self.attending) and all(modifier.merges_evicted for modifier in self.attending)
        #: by layer, the sliding window held as the model holds it (:meth:`slide`), or None: a global layer
        self.windows = [None] * len(layer_budgets) if windows is None else list(windows)
        self.learned_sinks = learned_sinks  # the model's softmax adds a learned logit per head (GPT-OSS)
        #: how the global layers hold their entries once the prompt is read (``cache.quant``: KIVI), or None: as given
        self.quant = quant
        self.allocation = self._allocation()
        args = (score_block, sums_kernel, layer_weights, self.allocation)
        self.scorer = Scorer(policy, self.eviction_layers, prompt_len, *args)
        self.decode_evict = decode_evict
        self.forward: Forward | None = None  # the forward under way (begin_forward)
        #: the context slots the next forward reconstructs (``reconstruction``; :meth:`reconstruct`), or None
        self.chunk: slice | None = None
        self.context_len = 0
        self.scaling = 1.0
        self.scoring_seconds = 0.0  # spent reconstructing the context (reconstruction.reconstruct)
        self.seen = 0  # the tokens the forwards declared so far (begin_forward)
        self.live_bytes = [0] * len(layer_budgets)
        self.peak_bytes = 0
        self.key_masks: list[torch.Tensor | None] = [None] * len(layer_budgets)
        #: the cascade of the forward that allocates a dynamic layer budget, while it runs
        self.stages: CascadeStages | None = None
        #: a reading policy's (:meth:`~kvbench.policies.base.Policy.read`) share of the held slots read, summed over
        #: its decode steps' reading layers and heads, and how many were summed (on the device: no wait per step)
        self.read_shares: torch.Tensor | float = 0.0
        self.reads = 0
        #: an observer of every eviction (the tests' brute-force checks), or None: ``watch(layer_idx, budget, scores,
        #: layer)``, a context the layer is evicted in (:meth:`_evict`'s arguments)
        self.watch: Callable[[int, int, torch.Tensor, EvictionLayer], AbstractContextManager[None]] | None = None

    @property
    def eviction_layers(self) -> list[EvictionLayer]:
        """``layers``, typed as what they are: ``__init__`` builds every layer as an :class:`EvictionLayer`
        (transformers types ``Cache.layers`` as a list of its own layer classes)."""
        return cast(list[EvictionLayer], self.layers)

    # -- called by the engine --------------------------------------------------------------------------
    def begin_forward(self, positions: torch.Tensor, evict: bool, decoding: bool = False) -> None:
        """Declare the next forward (:class:`~kvbench.engine.scoring.Forward`): ``positions [q]`` of its tokens,
        whether to evict after it, and whether it generates (after the prompt) rather than prefills. Its queries are
        scored (into a running score) when an eviction may follow: it evicts, or later ones do (``decode_evict``)."""
        self.seen += positions.shape[-1]
        last = evict and not self.decode_evict and self.seen >= self.prompt_len
        self.forward = Forward(positions, evict, evict or self.decode_evict, decoding, self.seen, last)

    def end_prefill(self) -> None:
        """The prompt is read: its global layers hold it as they decode from it now (:meth:`held_as_read`; else their
        first decode step does), so that what the cache holds after prefill is what it decodes from."""
        for index, window in enumerate(self.windows):
            if window is None:
                self.held_as_read(index)
                self.account(index)

    def held_as_read(self, layer_idx: int) -> None:
        """A global layer once the prompt is read, and at each decode step: its key channels pruned once where a
        modifier prunes them (ThinK, from the prompt's last queries, then let go), and a quantised cache's entries
        past KIVI's residual quantised."""
        layer = self.eviction_layers[layer_idx]
        if self.scorer.pruner is not None and layer.recent_queries is not None:
            layer.prune_channels(self.scorer.pruner.key_channels(layer.recent_queries, layer.keys))
            layer.recent_queries = layer.recent_query_positions = None
        if self.quant is not None:
            layer.roll(self.quant)

    def tokens_per_layer(self) -> list[int]:
        """Cached tokens per cache head, for every layer."""
        return [layer.tokens_per_head() for layer in self.eviction_layers]

    def sizes_now(self) -> CacheSizes:
        """What the cache holds now (:meth:`CacheSizes.held`)."""
        return CacheSizes.held(self.eviction_layers)

    def kept_by_head(self) -> list[list[list[int]]]:
        """The token positions each cache head of every layer holds (batch 0): ``[layer][head] → positions``."""
        return [[positions.tolist() for positions in layer.kept_by_head()] for layer in self.eviction_layers]

    def kept_positions(self) -> list[torch.Tensor]:
        """The absolute token positions each layer holds, ``[B,Hc,T_l]`` per layer, sorted within a head."""
        kept = []
        for layer in self.eviction_layers:
            assert layer.positions is not None  # every layer holds tokens after a forward
            assert layer.headwise is None, "a length per head: kept_by_head"
            kept.append(layer.positions)
        return kept

    def policy_stats(self) -> dict[str, Any]:
        """Per-sample statistics of the attending modifiers (CaliDrop's recomputation rate) and, with a
        dynamic layer budget, each layer's ``layer_preference``."""
        stats: dict[str, Any] = {}
        for modifier in self.attending:
            stats.update(modifier.policy_stats([layer.state_of(modifier) for layer in self.eviction_layers]))
        if self.allocation is not None:
            stats["layer_preference"] = list(self.allocation.preferences)
        if self.reads:
            stats["read_share"] = float(self.read_shares) / self.reads
        return stats

    def reconstruct(self, chunk: slice | None) -> None:
        """Declare the next forward a reconstruction of the context's ``chunk`` (the ``reconstruction`` statistic):
        each layer records the attention the chunk receives from it and drops the forward's own tokens after it;
        None ends the reconstruction."""
        if chunk is not None and self.chunk is None:
            self.context_len = self.eviction_layers[0].get_seq_length()
            for layer in self.eviction_layers:
                assert layer.positions is not None  # the context is prefilled first
                layer.received = torch.zeros(layer.positions.shape, device=layer.keys.device)  # [B,Hc,T]
        self.chunk = chunk

    def received(self) -> list[torch.Tensor]:
        """Every layer's ``reconstruction`` statistic ``[B,Hc,T]`` (after :meth:`reconstruct`)."""
        received = [layer.received for layer in self.eviction_layers]
        assert all(tensor is not None for tensor in received)  # reconstructed first
        return cast(list[torch.Tensor], received)

    def evict_reconstructed(self, received: list[torch.Tensor]) -> None:
        """Evict every layer of a prefilled context by the ``reconstruction`` statistic ``received`` (this cache's
        own or one gathered by a cache of the same context and settings), to the budgets the policy shares out
        once every layer is scored (:meth:`~kvbench.policies.base.Policy.layer_shares`)."""
        policy = self.policy
        for layer, statistic in zip(self.eviction_layers, received):
            layer.received = statistic
        forward = self._forward()
        bases = [
            policy.score(self.scorer.context(index, budget, forward)) for index, budget in enumerate(self.layer_budgets)
        ]
        head_budgets = policy.head_budgets(bases, self.layer_budgets)
        self.layer_budgets = policy.layer_shares(bases, self.layer_budgets)
        for index, (layer, budget) in enumerate(zip(self.eviction_layers, self.layer_budgets)):
            per_head = None if head_budgets is None else head_budgets[index]
            if layer.get_seq_length() > budget or per_head is not None:
                scores = self.scorer.scores(index, budget, self.scaling, None, forward)
                self._evict(index, budget, scores, self.scaling, per_head)
            layer.received = None

    # -- called by a cascade's stages (kvbench.engine.cascade) -----------------------------------------
    def shared_scores(self, layer_idx: int, budget: int, scaling: float, shared: SharedForward | None) -> torch.Tensor:
        """The layer's ranking for ``budget`` in this forward (:meth:`Scorer.shared_scores`)."""
        return self.scorer.shared_scores(layer_idx, budget, scaling, shared, self._forward())

    def preference_stats(self, layer_idx: int, scaling: float, shared: SharedForward | None) -> AttentionStats:
        """The attention statistics of the layer's observation window for its preference (a shared prefill's)."""
        return self.scorer.window(layer_idx, self.scorer.preference_window(), scaling, shared)

    def evict(self, layer_idx: int, budget: int, scaling: float, defer: bool = False) -> None:
        """Evict the layer to ``budget`` by its kept ranking (gathered by earlier evictions), its keys and values
        gathered later with ``defer``; a head-wise layer shares ``budget × Hc`` across its heads again, from the
        entries each holds."""
        ranking, held = self.eviction_layers[layer_idx].held_heads(self.policy.reserved_sinks())
        self._evict(layer_idx, budget, ranking, scaling, held=held, defer=defer)

    # -- called by the model / attention function ------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values ``[B,Hkv,q,D]`` (repeated to query heads in the repeat layout)."""
        key_states, value_states = in_cache_heads(key_states, value_states, self.num_query_heads, self.repeat_layout)
        layer, forward = self.eviction_layers[layer_idx], self._forward()
        if forward.decoding and self.chunk is None and self.windows[layer_idx] is None:
            self.held_as_read(layer_idx)  # before the first token after the prompt (not while a context is
            # reconstructed: KVzip), then KIVI's rest at each step
        if self.policy.running and self.scored_in(layer_idx) and layer.running_score is None:
            batch, heads, _, _ = key_states.shape
            layer.running_score = key_states.new_zeros(batch, heads, 0, dtype=torch.float32)
        layer.append(key_states, value_states, forward.positions)
        window = self.windows[layer_idx]  # a sliding layer holds its window (the forward's own keys pass through)
        self.account(layer_idx, None if window is None else min(layer.get_seq_length(), window - 1))
        keys, values, self.key_masks[layer_idx] = layer.attended()
        return keys, values

    def span(self) -> int:
        """The tokens of the sequence through this forward, its own included."""
        return self._forward().seen

    def key_mask(self, layer_idx: int) -> torch.Tensor | None:
        """Which keys the last :meth:`update` of ``layer_idx`` returned each cache head holds ``[Hc,T]``; None: all."""
        return self.key_masks[layer_idx]

    def scored_in(self, layer_idx: int) -> bool:
        """Whether this forward's queries are scored in the layer: an eviction may follow (:class:`Forward`'s
        ``scored``) and the layer is not one the model slides (never evicted by the policy)."""
        return self.forward is not None and self.forward.scored and self.windows[layer_idx] is None

    def window(self, layer_idx: int) -> int | None:
        """The sliding window the layer is held and attended through (the latest tokens, in order), or None: global."""
        return self.windows[layer_idx]

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Let attending modifiers replace a single-query forward's ``output [B,1,Hq,D]`` (in turn)."""
        layer = self.eviction_layers[layer_idx]
        for modifier in self.attending:
            replaced = modifier.attend(layer.state_of(modifier), query, keys, values, output, scaling)
            output = output if replaced is None else replaced
        return output

    def read(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """The slots ``[B,Hq,T]`` (True = read) each query head of a single query ``[B,Hq,1,D]`` reads of the layer's
        ``keys [B,Hc,T,D]`` where the policy reads part of the cache (:meth:`~kvbench.policies.base.Policy.read`,
        its share recorded), else None: every slot."""
        if not self.policy.reads or self.windows[layer_idx] is not None or not keys.shape[2]:
            return None
        read = self.policy.read(query, keys, self.layer_budgets[layer_idx], layer_idx)
        if read is not None:
            self.read_shares = self.read_shares + read.float().mean()
            self.reads += 1
        return read

    def wants_normaliser(self, layer_idx: int) -> bool:
        """Whether this forward's running sums read each query's log-sum-exp (:meth:`Scorer.wants_normaliser`)."""
        return self.chunk is None and self.windows[layer_idx] is None and self.scorer.wants_normaliser(self._forward())

    def after_attention(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        outputs: torch.Tensor,
        scaling: float,
        lse: torch.Tensor | None = None,
        summed: torch.Tensor | None = None,
        shared: SharedForward | None = None,
    ) -> None:
        """Gather this forward's scoring statistics from ``queries [B,Hq,q,D]``, their attention ``outputs
        [B,q,Hq,D]`` and ``lse`` where the attention gave it (the normalised ``summed`` when already computed for a
        variant with the same :func:`~kvbench.engine.scoring.sums_key`), and evict if due. ``shared``: what the
        variants of one shared prefill compute (window statistics by size, rankings by :meth:`Scorer.ranking_key`),
        each by the first that needs it."""
        policy, layer, forward = self.policy, self.eviction_layers[layer_idx], self._forward()
        self.scaling = scaling
        if (sliding := self.windows[layer_idx]) is not None:  # held as the model holds it, not scored nor evicted
            layer.slide(sliding)
            self.account(layer_idx)
            return
        if self.chunk is None:
            if not forward.scored:  # a decode step with no eviction to follow: nothing to gather (a row's usual step)
                return
            if self.attending:  # the newest query an eviction of this forward hands the attending modifiers
                layer.last_query = queries[:, :, -1].clone()
        budget = self.layer_budgets[layer_idx]
        if self.chunk is not None:
            assert layer.received is not None  # reconstruct sets it up
            sinks = policy.reserved_sinks()
            layer.received[..., self.chunk] = reconstruction_attention(queries, layer.keys, sinks, self.chunk, scaling)
            layer.truncate(self.context_len)
            self.account(layer_idx)
            return
        if policy.running:
            self.scorer.add_running(layer, forward, queries, outputs, scaling, budget, lse, summed)
        if window := self.scorer.query_window(budget):
            layer.remember_queries(queries, forward.positions.to(queries.device), window, shared)
        deferred = policy.statistic == "reconstruction"  # every layer scored first (evict_reconstructed)
        if forward.evict and policy.evicts and not deferred and layer.get_seq_length() > budget:
            if self.allocation is not None and layer_idx == self.allocation.stages:
                self.stages = self.stages or CascadeStages(self)
                self.stages.shared = shared  # what the stage ranks and scores from
                policy.layer_budget.cascade(self.allocation, self.stages, layer_idx, scaling)
            else:
                scores = self.shared_scores(layer_idx, budget, scaling, shared)
                self._evict(layer_idx, budget, scores, scaling, shared=shared)
        if window and forward.last_eviction:  # the prompt's queries let go (Expected Attention's: not held for 32
            # layers), but for the last a channel pruner reads once the prompt is read (:meth:`held_as_read`)
            layer.keep_last_queries(0 if self.scorer.pruner is None else self.scorer.pruner.channel_queries())
        if self.stages is not None and layer_idx == len(self.layers) - 1:  # the cascade's evictions, made once
            stages, self.stages = self.stages, None
            stages.finish(scaling)

    # -- internals -------------------------------------------------------------------------------------
    def _allocation(self) -> CascadingAllocation | None:
        """CAKE's cascading allocation for a dynamic ``layer_budget`` (None for static ones)."""
        budget = self.layer_budgets[0]
        reserved = self.policy.reserved(budget, self.prompt_len)
        if not self.policy.layer_budget.dynamic or not self.policy.evicts or reserved >= budget:
            return None
        return self.policy.layer_budget.allocation(budget, reserved, len(self.layers))

    def _forward(self) -> Forward:
        assert self.forward is not None  # begin_forward comes before the model's forward
        return self.forward

    def _evict(
        self,
        layer_idx: int,
        budget: int,
        scores: torch.Tensor,
        scaling: float,
        per_head: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
        defer: bool = False,
        shared: SharedForward | None = None,
    ) -> None:
        """Keep the top ``budget`` slots per cache head by ``scores [B,Hc,T]`` (or head-wise: :func:`kept_per_head`),
        reserved slots first; hand the evicted entries to the attending modifiers. ``shared``: a shared prefill's, where
        the variants of one ranking and budget keep one selection, made with all the layer's at its end
        (:meth:`SharedForward.select`) but where :attr:`watch` watches (each a new tensor, which none writes into)."""
        layer = self.eviction_layers[layer_idx]
        with nullcontext() if self.watch is None else self.watch(layer_idx, budget, scores, layer):
            recent, sinks = reserved_slots(self.policy, layer.get_seq_length(), budget, self.prompt_len)
            alone = self.watch is not None or layer.deferred_slots is not None  # its own selection, made now
            shares_later = self.policy.shares_heads and per_head is None and held is None  # with the others' at the end
            if shared is not None and not (alone or defer) and shares_later:
                keep = partial(self._kept_heads, layer_idx, scores)  # each head's share
                return shared.pend_heads(self.policy, scores, (budget, recent, sinks), keep)
            kept = kept_per_head(self.policy, scores, layer.get_seq_length(), budget, self.prompt_len, per_head, held)
            if kept is not None:
                return self._kept_heads(layer_idx, scores, kept, None, defer)
            layer.ranking = scores.float()
            if shared is None or alone:
                budget = ranked_budget(scores, recent, sinks) if self.policy.keeps_ranked_only else budget
                return self._kept(layer_idx, scaling, defer, None, None, top_slots(scores, budget, recent, sinks), None)
            key = self._selection_key(layer_idx, budget, recent, sinks)
            entries = (layer.keys, layer.values, cast(torch.Tensor, layer.positions))
            kept_by = partial(self._kept, layer_idx, scaling, defer, shared, key)
            ranked = self.policy.keeps_ranked_only  # whole chunks: the reserved and the ranked slots, counted then
            shared.pend(key, scores, (budget, recent, sinks), entries, kept_by, ranked, self._hands(defer))

    def _hands(self, defer: bool) -> bool:  # whether an eviction (defer: a cascade stage's) hands its dropped on now
        return bool(self.attending) and not (defer and self.merging)

    def _kept(
        self,
        layer_idx: int,
        scaling: float,
        defer: bool,
        shared: SharedForward | None,
        key: tuple | None,
        kept: torch.Tensor,
        gathered: tuple[torch.Tensor, ...] | None,
    ) -> None:
        """Keep ``kept [B,Hc,K]`` (entries ``gathered`` there or None); the evicted to the modifiers, once a ``key``."""
        layer = self.eviction_layers[layer_idx]
        evicted = None
        if self._hands(defer):  # the entries the modifiers are handed, once a selection
            evicted = shared.evicted.get(key) if shared is not None and key is not None else None
            evicted = layer.dropped_by(kept) if evicted is None else evicted
            if shared is not None and key is not None:
                shared.evicted[key] = evicted
        layer.keep(kept, defer=defer, gathered=gathered)
        if evicted is not None:  # i.e. there are attending modifiers
            assert layer.last_query is not None  # after_attention keeps it when modifiers attend
            for modifier in self.attending:
                modifier.on_evict(layer.state_of(modifier), evicted, layer.last_query, scaling)
        self.account(layer_idx)

    def _kept_heads(self, layer_idx: int, scores, kept, counts: list[int] | None, defer: bool = False) -> None:
        """Keep ``kept [1,Hc,T]`` head-wise (``counts``: how many each head keeps, where known), ranked ``scores``."""
        self.eviction_layers[layer_idx].keep_per_head(kept, scores, defer=defer, counts=counts)
        self.account(layer_idx)

    def _selection_key(self, layer_idx: int, budget: int, recent: int, sinks: int) -> tuple | None:
        """What a shared prefill's variants keeping one selection of a layer share (:meth:`_evict`): its ranking
        (:meth:`Scorer.ranking_key`), the entries it ranks, the budget and the reserved slots; None where the policy
        keeps its own number (whole chunks)."""
        layer = self.eviction_layers[layer_idx]
        ranking = self.scorer.ranking_key(budget, self._forward())
        if ranking is None or self.policy.keeps_ranked_only:
            return None
        return ranking, id(layer.keys), layer.get_seq_length(), budget, recent, sinks

    def account(self, layer_idx: int, tokens: int | None = None) -> None:
        """The layer's bytes held (``tokens`` per cache head if an eviction to them is to come; a cascade's logged)."""
        held = self.eviction_layers[layer_idx].held_bytes(tokens)
        if self.stages is None or not self.stages.logs(layer_idx, held):
            self.hold(layer_idx, held)

    def hold(self, layer_idx: int, held: int) -> None:
        """The layer holds ``held`` bytes now."""
        self.live_bytes[layer_idx] = held
        self.peak_bytes = max(self.peak_bytes, sum(self.live_bytes))

    # -- transformers Cache API --------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.eviction_layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0
