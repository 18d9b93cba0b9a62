"""A budgeted KV cache on transformers' ``Cache`` API.

Every layer stores, per cache head, the kept keys/values and their absolute token positions; eviction gathers the
kept entries into smaller tensors, so memory really shrinks. A head is ordered by position (kept indices sorted, new
tokens appended): its most recent ``r`` tokens are its last ``r`` slots.

Attending modifiers (CaliDrop, SLAKE) get every evicted entry through ``Modifier.on_evict`` and may
replace single-query attention through ``Modifier.attend``; each keeps its state in the layer's
``modifier_state[name]``. Dynamic layer budgets (``cake``, ``vabs``) are allocated in CAKE's cascading
manner while the first evicting forward passes through the layers: the strategy drives each stage
(:meth:`~kvbench.policies.layer_budget.LayerBudget.cascade`) through the cache's ranking, eviction and window
statistics.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import Cache

from kvbench.engine import attention
from kvbench.engine.cascade import CascadeStages
from kvbench.engine.layer import EvictionLayer, in_cache_heads
from kvbench.engine.selection import kept_per_head, reserved_slots, top_slots
from kvbench.engine.sizes import CacheSizes
from kvbench.policies.base import AttentionStats, Policy
from kvbench.policies.context import LayerWeights, ScoreContext
from kvbench.policies.layer_budget import CascadingAllocation
from kvbench.policies.stats import NormalisedStats, reconstruction_attention


def uses_normaliser(policy: Policy) -> bool:
    """Whether the cache adds a running policy's sums in one pass per forward, each weight from its query's
    normaliser beside the backend's attention output (``kvbench.policies.stats``: no second attention, no
    float32 softmax), rather than from float32 attention weights: where the policy scores causally (every
    re-weighting modifier gives the same sums from such a pass, :meth:`Modifier.contribution_sums`)."""
    return policy.running and policy.scores_causally


class EvictionCache(Cache):
    """A ``Cache`` whose layers are evicted to per-layer budgets by a ``Policy``.

    The engine calls :meth:`begin_forward` before each model forward with the absolute positions of the
    new tokens and whether this forward evicts; the kvbench attention function calls :meth:`update`
    (through the model), :meth:`attend` for single-query forwards and then :meth:`after_attention`, where
    scores are gathered and layers evicted. With a dynamic ``policy.layer_budget`` the ``layer_budgets``
    given (uniform) are the average, re-allocated during the first evicting forward. ``layer_weights``: each
    layer's weights that a score may read (:class:`~kvbench.policies.base.ScoreContext`).
    """

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
    ) -> None:
        super().__init__(layers=[EvictionLayer() for _ in layer_budgets])
        self.layer_weights = layer_weights
        self.policy = policy
        self.layer_budgets = list(layer_budgets)
        self.prompt_len = prompt_len
        self.num_query_heads = num_query_heads
        self.repeat_layout = policy.gqa == "repeat"
        self.cache_heads = num_query_heads if self.repeat_layout else num_kv_heads
        self.attn_backend = attn_backend
        self.score_block = score_block
        self.sums_kernel = sums_kernel
        self.attending = [modifier for modifier in policy.modifiers if modifier.attends]
        self.allocation = self._allocation()
        self.new_positions: torch.Tensor | None = None
        self.decode_evict = decode_evict
        self.evict_now = False
        #: the context slots the next forward reconstructs (``reconstruction``; :meth:`reconstruct`), or None
        self.chunk: slice | None = None
        self.context_len = 0
        self.scaling = 1.0
        self.scoring_seconds = 0.0  # spent reconstructing the context (reconstruction.reconstruct)
        self.scored = False
        self.decoding = False
        self.seen = 0  # the tokens the forwards declared so far (begin_forward)
        self.last_eviction = False
        self.live_bytes = [0] * len(layer_budgets)
        self.peak_bytes = 0
        self.key_masks: list[torch.Tensor | None] = [None] * len(layer_budgets)
        #: the cascade of the forward that allocates a dynamic layer budget, while it runs
        self.stages: CascadeStages | None = None

    @property
    def eviction_layers(self) -> list[EvictionLayer]:
        """``layers``, typed as what they are: ``__init__`` builds every layer as an :class:`EvictionLayer`
        (transformers types ``Cache.layers`` as a list of its own layer classes)."""
        return cast(list[EvictionLayer], self.layers)

    # -- called by the engine --------------------------------------------------------------------------
    def begin_forward(self, positions: torch.Tensor, evict: bool, decoding: bool = False) -> None:
        """Declare the next forward: ``positions [q]`` of its tokens, whether to evict after it, and whether it
        generates (after the prompt) rather than prefills. Its queries are ``scored`` (added to a running score)
        when an eviction may follow: it evicts, or later forwards do (``decode_evict``)."""
        self.new_positions = positions
        self.evict_now = evict
        self.scored = evict or self.decode_evict
        self.decoding = decoding
        self.seen += positions.shape[-1]
        #: no forward after this one evicts: what only an eviction reads is let go once this one has evicted
        self.last_eviction = evict and not self.decode_evict and self.seen >= self.prompt_len

    def tokens_per_layer(self) -> list[int]:
        """Cached tokens per cache head, for every layer."""
        return [layer.tokens_per_head() for layer in self.eviction_layers]

    def sizes_now(self) -> CacheSizes:
        """What the cache holds now: tokens per head of each layer, bytes, and each layer's range of head lengths
        where they differ."""
        lengths = [[len(head) for head in layer.kept_by_head()] for layer in self.eviction_layers]
        ranges = [[min(layer), max(layer)] for layer in lengths]
        return CacheSizes(
            after_prefill_tokens_per_layer=self.tokens_per_layer(),
            after_prefill_bytes=sum(layer.held_bytes() for layer in self.eviction_layers),
            after_prefill_head_range=ranges if any(low != high for low, high in ranges) else None,
        )

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
        bases = [policy.score(self._context(index, budget)) for index, budget in enumerate(self.layer_budgets)]
        head_budgets = policy.head_budgets(bases, self.layer_budgets)
        self.layer_budgets = policy.layer_shares(bases, self.layer_budgets)
        for index, (layer, budget) in enumerate(zip(self.eviction_layers, self.layer_budgets)):
            per_head = None if head_budgets is None else head_budgets[index]
            if layer.get_seq_length() > budget or per_head is not None:
                self._evict(index, budget, self._scores(index, budget, self.scaling), self.scaling, per_head)
            layer.received = None

    # -- called by a cascade's stages (kvbench.engine.cascade) -----------------------------------------
    def preference_stats(self, layer_idx: int, scaling: float, shared: dict | None) -> AttentionStats:
        """The attention statistics of the layer's observation window for its preference (a shared prefill's)."""
        return self._window(layer_idx, self._preference_window(), scaling, shared)

    def evict(self, layer_idx: int, budget: int, scaling: float, defer: bool = False) -> None:
        """Evict the layer to ``budget`` by its kept ranking (gathered by earlier evictions), its keys and values
        gathered later with ``defer``; a head-wise layer shares ``budget × Hc`` across its heads again, from the
        entries each holds."""
        layer = self.eviction_layers[layer_idx]
        held = None if layer.headwise is None else layer.unpack(self.policy.reserved_sinks())
        assert layer.ranking is not None  # ranked at its own stage of this forward
        self._evict(layer_idx, budget, layer.ranking, scaling, held=held, defer=defer)

    # -- called by the model / attention function ------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values ``[B,Hkv,q,D]`` (repeated to query heads in the repeat layout)."""
        key_states, value_states = in_cache_heads(key_states, value_states, self.num_query_heads, self.repeat_layout)
        layer = self.eviction_layers[layer_idx]
        if self.policy.running and self.scored and layer.running_score is None:
            batch, heads, _, _ = key_states.shape
            layer.running_score = key_states.new_zeros(batch, heads, 0, dtype=torch.float32)
        assert self.new_positions is not None  # begin_forward comes before the model's forward
        layer.append(key_states, value_states, self.new_positions)
        self.account(layer_idx)
        keys, values, self.key_masks[layer_idx] = layer.attended()
        return keys, values

    def key_mask(self, layer_idx: int) -> torch.Tensor | None:
        """Which of the keys the last :meth:`update` of ``layer_idx`` returned each cache head holds ``[Hc,T]``, or
        None: all of them."""
        return self.key_masks[layer_idx]

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

    def wants_normaliser(self, layer_idx: int) -> bool:
        """Whether this forward adds the fused pass's running sums (``engine.sums_kernel=triton``), which read each
        query's log-sum-exp: the attention then gives it with its output (:func:`~kvbench.engine.attention.
        cache_attention`) rather than a second call."""
        return self.sums_kernel == "triton" and self.scored and self.chunk is None and uses_normaliser(self.policy)

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

    def after_attention(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        outputs: torch.Tensor,
        scaling: float,
        lse: torch.Tensor | None = None,
        summed: torch.Tensor | None = None,
        shared: dict[tuple, Any] | None = None,
    ) -> None:
        """Gather this forward's scoring statistics from ``queries [B,Hq,q,D]``, their attention ``outputs
        [B,q,Hq,D]`` and ``lse`` where the attention gave it (the normalised ``summed`` when already computed for a
        variant with the same
        :func:`~kvbench.engine.batches.sums_key`), and evict if due. ``shared``: what the variants of one shared prefill
        compute (window statistics by size, rankings by :meth:`ranking_key`), each by the first that needs it."""
        policy, layer = self.policy, self.eviction_layers[layer_idx]
        self.scaling = scaling
        if self.chunk is None:
            if not self.scored:  # a decode step with no eviction to follow: nothing to gather (a row's usual step)
                return
            if self.attending:  # the newest query an eviction of this forward hands the attending modifiers
                layer.last_query = queries[:, :, -1].clone()
        budget = self.layer_budgets[layer_idx]
        assert self.new_positions is not None and layer.positions is not None  # set by begin_forward and update
        positions = self.new_positions.to(queries.device)
        if self.chunk is not None:
            assert layer.received is not None  # reconstruct sets it up
            sinks = policy.reserved_sinks()
            layer.received[..., self.chunk] = reconstruction_attention(queries, layer.keys, sinks, self.chunk, scaling)
            layer.truncate(self.context_len)
            self.account(layer_idx)
            return
        if policy.running:
            assert layer.running_score is not None  # created by update for scored forwards
            if uses_normaliser(policy):
                if summed is None:
                    summed = self.normalised_sums(queries, layer.keys, layer.values, outputs, scaling, lse)
                layer.running_score += summed
            else:
                seen = policy.scoring_positions(positions, budget, self.prompt_len)
                stats = AttentionStats(queries, layer.keys, layer.values, seen, layer.positions, scaling)
                layer.running_score += policy.summed_contributions(stats, self.score_block)
        window = self._query_window(budget)
        if window:
            layer.remember_queries(queries, positions, window, shared, layer_idx)
        deferred = policy.statistic == "reconstruction"  # every layer scored first (evict_reconstructed)
        if self.evict_now and policy.evicts and not deferred and layer.get_seq_length() > budget:
            if self.allocation is not None and layer_idx == len(self.allocation.preferences):
                self.stages = self.stages or CascadeStages(self)
                self.stages.shared = shared  # what the stage ranks and scores from
                policy.layer_budget.cascade(self.allocation, self.stages, layer_idx, scaling)
            else:
                self._evict(layer_idx, budget, self.shared_scores(layer_idx, budget, scaling, shared), scaling)
        if window and self.last_eviction:  # Expected Attention's: the prompt's queries, not held for 32 layers
            layer.recent_queries = layer.recent_query_positions = None
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

    def _query_window(self, budget: int) -> int:
        """How many recent queries to keep: the scoring window, and the preference window with a dynamic
        layer budget."""
        policy = self.policy
        window = 0
        if policy.statistic in ("window", "queries"):
            window = policy.scoring_window(budget, self.prompt_len)
        if self.allocation is not None:
            window = max(window, self._preference_window())
        return window

    def _preference_window(self) -> int:
        """The observation window of a dynamic layer budget's preference, at the average budget."""
        assert self.allocation is not None  # only with a dynamic layer budget
        policy = self.policy
        return policy.layer_budget.observation_window(policy.scoring_window(self.allocation.budget, self.prompt_len))

    def ranking_key(self, budget: int) -> tuple | None:
        """What a layer's ranking for ``budget`` depends on beyond its entries and statistics (one shared prefill's):
        what the policy ranks by (:attr:`~kvbench.policies.base.Policy.ranking_key`) and the windows it reads; None
        where it also reads the budget (:attr:`~kvbench.policies.base.Policy.ranking_reads_budget`) or budget-dependent
        running sums (not from the normaliser). (A cascading layer budget's stage ranks its layer in full, at the
        average budget, like any variant's eviction.)"""
        policy = self.policy
        if policy.ranking_reads_budget or (policy.running and not uses_normaliser(policy)):
            return None
        recent = min(policy.reserved_recent(budget, self.prompt_len), budget)
        window = policy.scoring_window(budget, self.prompt_len, self.decoding)
        return policy.ranking_key, recent, window, policy.reserved_sinks()

    def shared_scores(self, layer_idx: int, budget: int, scaling: float, shared: dict | None) -> torch.Tensor:
        """:meth:`_scores`, taken from (or put in) ``shared`` under :meth:`ranking_key` with the layer's index."""
        key = None if shared is None else self.ranking_key(budget)
        if shared is None or key is None:
            return self._scores(layer_idx, budget, scaling, shared)
        key = ("ranking", layer_idx, *key)
        if key not in shared:
            shared[key] = self._scores(layer_idx, budget, scaling, shared)
        return shared[key].clone()  # the cache keeps its ranking (EvictionLayer.ranking): its own copy

    def _scores(
        self, layer_idx: int, budget: int, scaling: float, shared: dict[tuple, Any] | None = None
    ) -> torch.Tensor:
        """The policy's ranking of every cached slot ``[B,Hc,T]`` (before reserving) for ``budget``, from the
        statistic it declares (:attr:`~kvbench.policies.base.Policy.statistic`)."""
        return self.policy.ranking(self._context(layer_idx, budget, scaling, shared))

    def _context(self, layer_idx: int, budget: int, scaling: float = 1.0, shared: dict | None = None) -> ScoreContext:
        """What the policy ranks the layer's slots from for ``budget`` (its declared statistic gathered)."""
        policy, layer = self.policy, self.eviction_layers[layer_idx]
        assert layer.positions is not None
        summed, window = None, None
        if policy.statistic in ("window", "queries"):
            window = self._window(
                layer_idx, policy.scoring_window(budget, self.prompt_len, self.decoding), scaling, shared
            )
            if policy.statistic == "window":
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
            layer.keys, layer.values, layer.positions, summed, recent, window, weights, sinks, budget, shared, self.seen
        )

    def _window(self, layer_idx: int, size: int, scaling: float, shared: dict | None) -> AttentionStats:
        """The layer's statistics of its last ``size`` queries: one per layer and size for a shared prefill's variants
        (``shared``; its tensors computed once, lazily)."""
        if shared is None:
            return self.eviction_layers[layer_idx].window_stats(size, scaling)
        if ("window", layer_idx, size) not in shared:
            shared["window", layer_idx, size] = self.eviction_layers[layer_idx].window_stats(size, scaling)
        return shared["window", layer_idx, size]

    def _evict(
        self,
        layer_idx: int,
        budget: int,
        scores: torch.Tensor,
        scaling: float,
        per_head: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
        defer: bool = False,
    ) -> None:
        """Keep the top ``budget`` slots per cache head by ``scores [B,Hc,T]`` (or head-wise: :func:`kept_per_head`),
        reserved slots first; hand the evicted entries to the attending modifiers."""
        layer = self.eviction_layers[layer_idx]
        kept = kept_per_head(self.policy, scores, layer.get_seq_length(), budget, self.prompt_len, per_head, held)
        if kept is not None:
            layer.keep_per_head(kept, scores)
            self.account(layer_idx)
            return
        layer.ranking = scores.float()
        recent, sinks = reserved_slots(self.policy, layer.get_seq_length(), budget, self.prompt_len)
        if self.policy.keeps_ranked_only:  # whole chunks: the reserved and the ranked slots
            ranked = torch.isfinite(scores[..., sinks : scores.shape[-1] - recent]).sum(dim=-1).min()
            budget = sinks + recent + int(ranked)
        kept = top_slots(scores, budget, recent, sinks)
        evicted = layer.dropped_by(kept) if self.attending else None
        layer.keep(kept, defer=defer)
        if evicted is not None:  # i.e. there are attending modifiers
            assert layer.last_query is not None  # after_attention keeps it when modifiers attend
            for modifier in self.attending:
                modifier.on_evict(layer.state_of(modifier), evicted, layer.last_query, scaling)
        self.account(layer_idx)

    def account(self, layer_idx: int, tokens: int | None = None) -> None:
        """The layer's bytes held (``tokens`` per cache head where an eviction to them is yet to be made)."""
        self.live_bytes[layer_idx] = self.eviction_layers[layer_idx].held_bytes(tokens)
        self.peak_bytes = max(self.peak_bytes, sum(self.live_bytes))

    # -- transformers Cache API --------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.eviction_layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0
