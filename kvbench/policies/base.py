"""The policy interface: score cached tokens from attention statistics, keep the top ``budget`` per KV head.

A *base* policy (``h2o``, ``tova``, ``snapkv`` ...) says which queries feed the score, what is reserved (sinks, recent
windows) and how the summed score is post-processed (pooling). A *modifier* (``caote``, ``obcache_joint`` ...) replaces
the per-query contribution or re-weights the summed score; the spec ``base+modifier+...`` composes them
(``kvbench.policies.build_policy``). Attending modifiers (``calidrop``, ``slake``) instead receive every evicted entry
(``on_evict``) and may replace the attention output of single-query forwards (``attend``), keeping per-layer state in a
slot the cache gives them. A channel pruner (``think``) prunes the prompt's key channels (``key_channels``).

Ranking pipeline for one layer (shapes: B batch, Hq query heads, Hc cache heads — the KV heads, or the query
heads with ``gqa=repeat`` —, W scoring queries, T cached tokens)::

    contributions [B,Hq,W,T] --sum over W--> [B,Hq,T] --GQA: sum | mean over the group, or repeat--> [B,Hc,T]
      (running policies add this to a running score) = ScoreContext.summed --Policy.score: base.pool_scores,
      modifier.transform...--> ranking [B,Hc,T]

The contract with the cache is small: a policy declares once which attention statistic it scores from
(:attr:`Policy.statistic`), the cache gathers that statistic and hands it to :meth:`Policy.score` in a
:class:`ScoreContext`, then selects once per cache head (``kvbench.engine.cache``): the reserved slots (the first
``reserved_sinks()``, the last ``reserved_recent()``) and the top-ranked of the slots between them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch

from kvbench.budgets import Budget
from kvbench.domains import choice, setting
from kvbench.errors import KVBenchError
from kvbench.kernels.sums import attention_sums
from kvbench.policies.context import ATTENTION, Evicted, ScoreContext, Statistic
from kvbench.policies.layer_budget import LayerBudget, Uniform
from kvbench.policies.parts import part_settings, settings_key
from kvbench.policies.registry import Registered
from kvbench.policies.scores import GqaMode, reduce_gqa
from kvbench.policies.stats import AttentionStats, NormalisedBlock, NormalisedStats, QueryBlock

GQA_MODES = ("sum", "mean", "repeat")
#: how a modifier that reads the budget counts what it keeps (ChunkKV, CriticalKV): over the slots the base leaves to
#: choose (its sinks and window reserved), or as kvpress counts, over every slot with the reserved ones scored highest
#: (``+compat=kvpress``)
COUNTINGS = ("selectable", "kvpress")


@dataclass
class Modifier(Registered):
    """Re-weights a base policy's ranking (CAOTE, OBCache) or changes decode attention (CaliDrop, SLAKE)."""

    registry = "modifier"
    # -- what it does, declared (the cache and the spec parser read these, never which methods are overridden) --
    #: replaces each query's contribution ``A_ip`` by its own terms (:meth:`contribution_sums`); at most one such
    #: modifier per spec
    reweights: ClassVar[bool] = False
    #: re-weights the base's ranking (:meth:`transform`)
    transforms: ClassVar[bool] = False
    #: re-ranks an attention score only (CAOTE normalises it to a distribution); False: any base's score
    needs_attention: ClassVar[bool] = True
    #: keeps a per-layer state (:meth:`new_state`), receives evicted entries (:meth:`on_evict`) and may replace
    #: single-query attention while decoding (:meth:`attend`)
    attends: ClassVar[bool] = False
    #: what its state holds after several evictions of one forward is what it holds when handed their entries at once,
    #: up to float rounding (SLAKE's sums; CaliDrop's store and its attention, merged by log-sum-exp), and nothing
    #: reads it before decoding: a cascade hands each layer's evicted entries once, at its last budget
    merges_evicted: ClassVar[bool] = False
    #: its :meth:`policy_stats` read its layers' state (CaliDrop's counts): a finished row stored on the shelves of
    #: stored rows takes its state back (the others' are let go with the row)
    reports_state: ClassVar[bool] = False
    #: gives each cache head of a layer its own share of the layer's budget (:meth:`head_shares`: AdaKV); the
    #: cache then holds a different number of entries per head
    shares_heads: ClassVar[bool] = False
    #: its re-ranking reads the budget (``ScoreContext.budget``: CriticalKV's first stage); False: one ranking of a
    #: layer serves every budget with the same windows (:attr:`Policy.ranking_reads_budget`)
    reads_budget: ClassVar[bool] = False
    #: its ranking marks the slots it does not keep ``-inf`` (:meth:`transform`): the layer keeps its reserved slots
    #: and the ranked ones, which may be fewer or more than the budget (ChunkKV keeps whole chunks)
    keeps_ranked_only: ClassVar[bool] = False

    @classmethod
    def inapplicable(cls, base: type[Policy]) -> str | None:
        """Why this modifier cannot modify the base policy class ``base``, or None: nothing is evicted from a
        base that never evicts; a base that ranks by position has no attention score to re-rank."""
        if not base.evicts:
            return f"{base.name} evicts nothing"
        statistic = base().statistic
        if not cls.attends and statistic not in ATTENTION and (cls.needs_attention or statistic == "positions"):
            hows = {"positions": "by position", "entries": "by its cached entries", "queries": "by its queries"}
            how = hows.get(statistic, "by its context's reconstruction")
            return f"{base.name} ranks tokens {how}, with no attention score for {cls.name} to re-rank"
        return None

    def refusal(self, policy: Policy, regime: str, query_agnostic: bool, decode_evict: bool) -> str | None:
        """Why ``policy`` (this modifier's) is not defined under ``regime`` (:meth:`Policy.refusal`), or None."""
        return None

    def head_shares(self, scores: torch.Tensor, budget: int, reserved: int) -> torch.Tensor:
        """How many of a layer's unreserved slots each cache head keeps ``[B,Hc]`` (``shares_heads``) of ``budget``
        per head on average, ``reserved`` of them its sinks and window, by their ranking ``scores [B,Hc,M]``."""
        raise NotImplementedError(f"{self.name} declares shares_heads and defines no head_shares")

    def channel_queries(self) -> int:
        """How many of the prompt's last queries :meth:`key_channels` reads (ThinK's window); 0: none pruned."""
        return 0

    def key_channels(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The channels each cache head keeps ``[B,Hc,D']`` once the prompt is read, from its last queries and keys."""
        raise NotImplementedError(f"{self.name} reads channel_queries and defines no key_channels")

    def bind(self, base: Policy) -> None:
        """Adapt to the base policy it modifies (e.g. CAOTE's per-base norm exponent); default nothing."""

    def default_layer_budget(self, base: Policy) -> LayerBudget | None:
        """The layer budget this modifier brings to ``base`` when none is configured (SLAKE's VABS over CAKE), or None
        to keep the base's."""
        return None

    def contribution_sums(self, block: QueryBlock) -> torch.Tensor:
        """``Σ_i`` over the block's query rows of this modifier's terms replacing ``A_ip`` (``reweights``) ``[..., T]``.

        One form serves both ways the cache gathers attention: a window's :class:`~kvbench.policies.stats.QueryTerms`
        (``[B,Hkv,G,W,T]``: one sum per query head) and a normalised pass's
        :class:`~kvbench.policies.stats.NormalisedBlock` (rows = the group's queries: one sum per cache head)."""
        raise NotImplementedError(f"{self.name} declares reweights and defines no contribution_sums")

    def sum_terms(self) -> tuple[float, float, float] | None:
        """Where :meth:`contribution_sums` is an output error ``Σ_i A_ip² ‖α_ip v_p − β_ip o_i‖²`` with
        ``α = a0 + a1·Z`` and ``β = b1·Z``: ``(a0, a1, b1)``, which the fused pass computes
        (:mod:`kvbench.kernels.sums`); else None."""
        return None

    def transform(self, scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        """Re-rank the base's ranking ``[B,Hc,T]`` of the layer's slots given what the base read (``transforms``)."""
        return scores

    def new_state(self) -> Any:
        """This modifier's empty per-layer state (an attending modifier's own dataclass)."""
        return None

    def on_evict(self, state: Any, evicted: Evicted, last_query: torch.Tensor, scaling: float) -> None:
        """A layer just evicted ``evicted`` (prefill or decode); ``state`` is this modifier's state in that
        layer (:meth:`new_state`) and ``last_query [B,Hq,D]`` the layer's newest query. Called only when
        ``attends``."""

    def attend(
        self,
        state: Any,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A single-query forward attended with ``query [B,Hq,1,D]`` over the kept ``keys``/``values
        [B,Hc,T,D]`` (its own token included; ``visible [B,T]``: those each row holds, None: all) and got ``output
        [B,1,Hq,D]``; return a replacement or None."""
        return None

    def policy_stats(self, states: list[Any]) -> dict[str, Any]:
        """Per-sample statistics from every layer's slot (e.g. CaliDrop's recomputation rate)."""
        return {}

    def stores(self) -> bool:
        """Whether a stored row's decode attends with the others' on a shelf, its state held there (:meth:`units`)."""
        return False

    def units(self, state: Any) -> dict[str, torch.Tensor] | None:
        """Where its rows decode on the shelves of stored rows (:meth:`stores`, :mod:`kvbench.engine.store`): the
        tensors ``[1,Hc,...]`` of ``state`` that :meth:`attend` reads and writes, by name (None while it holds
        nothing: :meth:`attend` gives None); :meth:`of_units` makes a state of the same tensors ``[S,1,...]``, one
        (row, cache head) each (zero-padded to the longest), which :meth:`attend` is given with ``visible [S,T]``,
        the keys each unit holds."""
        raise NotImplementedError(f"{self.name} declares stores and defines no units")

    def of_units(self, tensors: dict[str, torch.Tensor]) -> Any:
        raise NotImplementedError(f"{self.name} declares stores and defines no of_units")


@dataclass
class Policy(Registered):
    """A base eviction policy. Subclasses set the class variables and override the hooks they need."""

    registry = "base"
    evicts: ClassVar[bool] = True  # False: never evicts, whatever the budget (``full``)
    #: a single query reads part of the cache (:meth:`read`), which is kept whole (Quest)
    reads: ClassVar[bool] = False
    #: its score reads the budget (``ScoreContext.budget``); False: a layer's ranking depends on the budget only through
    #: the windows it reads (recent, scoring, sinks): variants at several budgets share one (``Scorer.ranking_key``)
    reads_budget: ClassVar[bool] = False
    #: what it holds is bounded by the budget; False: it keeps whole layers or heads whatever the budget (SimLayerKV)
    bounded: ClassVar[bool] = True
    #: its scores repeat by construction (LagKV's ranks within each partition): which of the equal ones a layer keeps
    #: is top-k's choice among them, so shrinking a layer stage by stage may keep others than one top-k at its last
    #: budget, and a cascade evicts at every stage (:class:`~kvbench.engine.cascade.CascadeStages`)
    ranks_with_ties: ClassVar[bool] = False

    #: GQA: sum the scores of a KV head's query heads (OBCache App. B.5), average them, or ``repeat``
    #: (KV stored per query head, each choosing its own tokens: the SnapKV / KVCache-Factory layout)
    gqa: GqaMode = setting(choice(*GQA_MODES), "sum")
    #: how layers share the budget (``kvbench.policies.layer_budget``)
    layer_budget: LayerBudget = field(default_factory=Uniform)
    modifiers: list[Modifier] = field(default_factory=list, repr=False)

    # -- hooks ---------------------------------------------------------------------------------------
    @property
    def statistic(self) -> Statistic:
        """The attention statistic this policy scores from (:data:`Statistic`): its one declaration to the cache."""
        return "window"

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        """How many of the most recent queries are scored at eviction time (the ``window`` statistic);
        ``decoding``: an eviction during generation rather than prefill."""
        return 1

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        """How many of the most recent tokens are always kept."""
        return 0

    @property
    def scores_causally(self) -> bool:
        """Whether each scoring query weighs only the keys up to its own position (as it attends); a policy that
        scores non-causally says so here and moves them in :meth:`scoring_positions`."""
        return True

    def scoring_positions(self, query_positions: torch.Tensor, budget: int, prompt_len: int) -> torch.Tensor:
        """The positions the queries of one forward ``[q]`` score from: a query sees the keys at positions up to
        its own; a policy that scores non-causally moves them (the attention output stays causal)."""
        return query_positions

    def reserved_sinks(self) -> int:
        """How many of the first tokens (attention sinks) are always kept."""
        return 0

    def refusal(self, regime: str, query_agnostic: bool, decode_evict: bool = False) -> str | None:
        """Why this policy is not defined under ``regime`` (``engine.regime``), without a context split
        (``query_agnostic``: ``task.query_mode=agnostic``) or evicting while it decodes (``decode_evict``), or
        None: a base runs everywhere by default; a modifier may refuse (:meth:`Modifier.refusal`)."""
        for modifier in self.modifiers:
            refusal = modifier.refusal(self, regime, query_agnostic, decode_evict)
            if refusal is not None:
                return refusal
        return None

    def reconstruction_chunk(self) -> int:
        """Context tokens each reconstruction forward repeats (the ``reconstruction`` statistic)."""
        return 2048

    def layer_shares(self, rankings: list[torch.Tensor], budgets: list[int]) -> list[int]:
        """Per-layer budgets once every layer's ranking ``[B,Hc,T_l]`` is known before any evicts (the
        ``reconstruction`` statistic), from the ``budgets`` allocated beforehand: by default those."""
        return budgets

    @property
    def ranking_reads_budget(self) -> bool:
        """Whether the base or a modifier reads the budget to rank (:attr:`reads_budget`)."""
        return self.reads_budget or any(modifier.reads_budget for modifier in self.modifiers)

    @property
    def shares_heads(self) -> bool:
        """Whether a modifier gives each cache head its own share of a layer's budget (:meth:`head_shares`)."""
        return any(modifier.shares_heads for modifier in self.modifiers)

    @property
    def keeps_ranked_only(self) -> bool:
        """Whether a modifier ranks only the slots it keeps (:attr:`Modifier.keeps_ranked_only`)."""
        return any(modifier.keeps_ranked_only for modifier in self.modifiers)

    def head_shares(self, scores: torch.Tensor, budget: int, reserved: int) -> torch.Tensor | None:
        """How many of a layer's unreserved slots each cache head keeps ``[B,Hc]`` given their ranking ``scores
        [B,Hc,M]`` (:meth:`Modifier.head_shares`), or None: each head ``budget − reserved`` (the default)."""
        for modifier in self.modifiers:
            if modifier.shares_heads:
                return modifier.head_shares(scores, budget, reserved)
        return None

    def head_budgets(self, rankings: list[torch.Tensor], budgets: list[int]) -> list[torch.Tensor] | None:
        """Per layer, the slots each cache head keeps ``[B,Hc]`` (its reserved ones included) once every layer's
        ranking ``[B,Hc,T_l]`` is known before any evicts (the ``reconstruction`` statistic), or None: each head its
        layer's budget (the default)."""
        return None

    def read(self, query: torch.Tensor, keys: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor | None:
        """The slots ``[B,Hq,T]`` (True = read) each query head of a single query ``[B,Hq,1,D]`` reads of layer
        ``layer_idx``'s ``keys [B,Hc,T,D]`` at ``budget`` tokens (a policy that ``reads``), or None: every slot."""
        return None

    def compresses(self, budget: int, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens is evicted at ``budget``: one longer than the budget."""
        return budget < prompt_len

    def pool_scores(self, scores: torch.Tensor, recent: int) -> torch.Tensor:
        """Post-process summed per-KV-head scores ``[B,Hkv,T]`` whose last ``recent`` slots are the
        reserved window (SnapKV pools the rest); default identity."""
        return scores

    def score(self, context: ScoreContext) -> torch.Tensor:
        """The base's ranking ``[B,Hc,T]`` of one layer's cached slots (higher is kept): by position (newer higher)
        for the ``positions`` statistic, else the summed statistic pooled (:meth:`pool_scores`). A base of the
        ``entries`` or ``queries`` statistic defines its own."""
        if context.summed is None:
            return context.positions.float()
        return self.pool_scores(context.summed, context.recent)

    def share_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """The final ranking ``[B,Hc,T]`` from each head's: default each head its own (TOVA: one per layer)."""
        return scores

    def ranking(self, context: ScoreContext, scores: torch.Tensor | None = None) -> torch.Tensor:
        """What the cache selects by: :meth:`score` (``scores`` where given: its variants' shared one), re-ranked by
        each modifier that ``transforms``, then :meth:`share_heads`."""
        scores = self.score(context) if scores is None else scores
        for modifier in self.modifiers:
            if modifier.transforms:
                scores = modifier.transform(scores, context)
                if context.score_key is not None:  # the next re-ranks a re-ranked score
                    context = replace(context, score_key=None)
        return self.share_heads(scores)

    def reduce_queries(self, parts: Iterable[torch.Tensor], tokens: int) -> torch.Tensor:
        """One score per query head ``[B,Hq,T]`` from the scoring queries' contributions, given block by block
        ``[B,Hq,w,T_b]`` (a block sees the first ``T_b ≤ tokens`` slots): H2O eq. 2's ``Σ_i`` (CAKE: mean + γ·var)."""
        total: torch.Tensor | None = None
        for part in parts:
            if total is None:
                total = part.new_zeros(part.shape[0], part.shape[1], tokens)  # [B,Hq,T]
            summed = part.sum(dim=-2)  # [B,Hq,T_b]
            total[..., : summed.shape[-1]] += summed
        assert total is not None  # the statistics have at least one block
        return total

    # -- shared machinery ----------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        return "+".join([self.name, *(modifier.name for modifier in self.modifiers)])

    @property
    def key(self) -> str:
        """What makes two policies the same computation: the base's and every modifier's name and settings
        (:func:`settings_key`), the budget not among them."""
        return settings_key(self, *self.modifiers)

    @property
    def ranking_key(self) -> str:
        """What makes two policies rank a layer alike (the budget not among it): the base's settings but how layers
        share the budget, and the modifiers that re-rank or re-weight; one that only shares a layer's budget over its
        heads (AdaKV) or attends the evicted (CaliDrop, SLAKE) ranks as its base."""
        ranking = [modifier for modifier in self.modifiers if modifier.transforms or modifier.reweights]
        return settings_key(self, *ranking, without=("layer_budget",))

    @property
    def label(self) -> str:
        """The name results give this policy's cells: its spec, unless a setting makes it another method (KVzip's
        ``headwise``), which tags it."""
        return self.spec

    @property
    def running(self) -> bool:
        """Whether the statistic is a running score, summed over every scored query."""
        return self.statistic == "running"

    @property
    def reweighting(self) -> Modifier | None:
        """The modifier that replaces each query's contribution (``reweights``; one at most), or None."""
        return next((modifier for modifier in self.modifiers if modifier.reweights), None)

    def contributions(self, stats: AttentionStats) -> torch.Tensor:
        """Per-query contributions ``[B,Hq,W,T]``: ``A_ip``, or the re-weighting modifier's summed over the window
        ``[B,Hq,1,T]``."""
        modifier = self.reweighting
        if modifier is None:
            return stats.weights
        batch, q_heads, _, tokens = stats.weights.shape
        return modifier.contribution_sums(stats.grouped()).reshape(batch, q_heads, 1, tokens)

    def summed_contributions(self, stats: AttentionStats, block_size: int | None = None) -> torch.Tensor:
        """The scoring queries' contributions folded by :meth:`reduce_queries` (block by block), reduced over each
        KV group (OBCache App. B.5: the GQA score is the sum over the group): ``[B,Hkv,T]``."""
        parts = (self.contributions(block) for block in stats.blocks(block_size))
        return reduce_gqa(self.reduce_queries(parts, stats.keys.shape[2]), stats.keys.shape[1], mode=self.gqa)

    def normalised_sums(self, stats: NormalisedStats, block_size: int | None = None) -> torch.Tensor:
        """One pass over the query blocks of ``stats`` whose weights come from each query's normaliser:
        ``Σ_i contributions[i]`` reduced over each KV group ``[B,Hc,T]`` (H2O eq. 2, or the last modifier's
        replacement), equal to :meth:`summed_contributions` up to rounding."""
        batch, heads, tokens, _ = stats.keys.shape
        fused = self.fused_terms() if stats.fused else False
        if fused is not False:  # one fused pass (the engine asked for it: engine.sums_kernel=triton)
            assert stats.lse is not None  # the engine gives the normaliser with the fused pass
            total = attention_sums(
                stats.queries, stats.keys, stats.values, stats.outputs, stats.lse, stats.scaling, fused
            )
        else:
            total = torch.zeros(batch, heads, tokens, device=stats.keys.device)  # [B,Hc,T]
            for block in stats.blocks(block_size):
                part = self.block_sums(block)  # [B,Hc,T_b]
                total[..., : part.shape[-1]] += part
        group = stats.queries.shape[1] // heads
        return total / group if self.gqa == "mean" else total

    def fused_terms(self) -> tuple[float, float, float] | None | Literal[False]:
        """What the fused pass computes for :meth:`normalised_sums` (:func:`~kvbench.kernels.sums.attention_sums`'
        ``terms``): None for H2O's ``Σ_i A_ip``, the re-weighting modifier's :meth:`Modifier.sum_terms`, or False where
        it has none (its blocks are summed as they are)."""
        modifier = self.reweighting
        if modifier is None:
            return None
        terms = modifier.sum_terms()
        return False if terms is None else terms

    def block_sums(self, block: NormalisedBlock) -> torch.Tensor:
        """``Σ_i contributions[i]`` over one normalised block ``[B,Hc,T_b]``: the re-weighting modifier's, else
        H2O eq. 2's ``Σ_i A_ip``."""
        modifier = self.reweighting
        return block.weight_sums() if modifier is None else modifier.contribution_sums(block)

    def reserved(self, budget: int, prompt_len: int) -> int:
        """Slots always kept per cache head: the recent window and the sinks."""
        return self.reserved_recent(budget, prompt_len) + self.reserved_sinks()

    def budget_refusal(self, budget: int, prompt_len: int) -> str | None:
        """Why ``budget`` is refused for a prompt of ``prompt_len`` tokens, or None: where the reserved sinks and recent
        window fill it, a scoring policy would keep no heavy hitter and become a recency policy."""
        reserved = self.reserved(budget, prompt_len)
        if self.evicts and self.statistic in ATTENTION and budget < prompt_len and reserved >= budget:
            return (
                f"policy {self.spec} reserves {reserved} of its {budget}-token budget (window/sinks) in a prompt "
                "longer than the budget: no heavy hitters are left; lower policy.window or raise the budget"
            )
        return None

    def check_budget(self, budget: int, prompt_len: int) -> None:
        """:meth:`budget_refusal` as a one-line error."""
        refusal = self.budget_refusal(budget, prompt_len)
        if refusal is not None:
            raise KVBenchError(refusal)

    def for_model(self, model_id: str | None, budget: Budget) -> None:
        """Fill in the per-model settings of the layer budget (CAKE's τ, SLAKE's VABS α/β) for the model
        with Hugging Face id ``model_id`` at ``budget``."""
        self.layer_budget = self.layer_budget.for_model(model_id, budget)

    def settings(self) -> dict[str, Any]:
        """Every setting of this policy as its Hydra node holds it: ``name`` (the spec), the base's fields,
        ``layer_budget`` as ``{name: ..., ...}`` and each modifier's fields."""
        return {"name": self.spec, **{k: v for part in (self, *self.modifiers) for k, v in part_settings(part).items()}}
