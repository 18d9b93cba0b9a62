"""Several caches through one forward: a shared prefill (:class:`SharedPrefill`: one oneshot forward for the caches
of several variants of a prompt) and rows (:class:`RowBatch`: each row of a forward over its own cache)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvbench.engine.cache import EvictionCache
from kvbench.engine.layer import in_cache_heads
from kvbench.engine.scoring import sums_key
from kvbench.engine.sharing import SharedForward
from kvbench.engine.store import RowStore


class SharedPrefill(Cache):
    """One oneshot prefill forward for the caches of several variants of a prompt (their own policies and budgets;
    one head layout): each layer's keys and values are computed and attended in full once, by the backend; after
    the layer's attention each variant in turn takes them (one contiguous copy, which every variant holds until it
    evicts: a cascade's deferred evictions hold it to the forward's end), scores and evicts to its own budget
    (variants with the same :func:`sums_key` add one normalised pass's sums, those with the same
    ``Scorer.ranking_key`` select from one ranking, those with one query window hold one copy of it), so
    never a full cache per variant."""

    def __init__(self, caches: list[EvictionCache]) -> None:
        lead = caches[0]
        super().__init__(layers=[DynamicLayer() for _ in lead.layers])  # never filled: the model reads length 0
        self.caches = caches
        self.attn_backend = lead.attn_backend
        self.repeat_layout, self.num_query_heads = lead.repeat_layout, lead.num_query_heads
        self.prompt_len = lead.prompt_len
        self.layer_states: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's, as the model gave them
        self.attended: tuple[torch.Tensor, torch.Tensor] | None = None  # the same in the cache's heads

    def begin_forward(self, positions: torch.Tensor, evict: bool, decoding: bool = False) -> None:
        for cache in self.caches:
            cache.begin_forward(positions, evict, decoding)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys/values ``[B,Hkv,T,D]`` to attend (repeated to query heads in the repeat layout), kept
        for the variants until :meth:`after_attention`."""
        self.layer_states = (key_states, value_states)
        self.attended = in_cache_heads(key_states, value_states, self.num_query_heads, self.repeat_layout)
        return self.attended

    def span(self) -> int:
        """The prompt's tokens through this forward (the same for every variant)."""
        return self.caches[0].span()

    def key_mask(self, layer_idx: int) -> None:
        """Every head holds every key of a shared prefill (its caches evict after it)."""
        return None

    def window(self, layer_idx: int) -> int | None:
        """The sliding window of the layer (the same for every variant: the model's)."""
        return self.caches[0].window(layer_idx)

    def wants_normaliser(self, layer_idx: int) -> bool:
        """Whether a variant's scoring reads each query's log-sum-exp (:meth:`EvictionCache.wants_normaliser`)."""
        return any(cache.wants_normaliser(layer_idx) for cache in self.caches)

    def after_attention(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        outputs: torch.Tensor,
        scaling: float,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Each variant in turn: append the layer's keys/values, score with ``queries [B,Hq,T,D]``, their
        ``outputs [B,T,Hq,D]`` and ``lse`` where the attention gave it (the normalised sums computed once per
        :func:`sums_key`) and evict."""
        assert self.layer_states is not None and self.attended is not None  # update comes before the attention
        key_states, value_states = (states.contiguous() for states in self.layer_states)  # one copy all variants hold
        attended, self.layer_states, self.attended = self.attended, None, None
        sums: dict[str, torch.Tensor] = {}
        shared = SharedForward(layer_idx)  # the window statistics, rankings and selections the variants share
        for cache in self.caches:
            cache.update(key_states, value_states, layer_idx)
            key = sums_key(cache.policy)
            if key is not None and cache.scored_in(layer_idx) and key not in sums:
                sums[key] = cache.scorer.normalised_sums(queries, *attended, outputs, scaling, lse)
            summed = None if key is None else sums.get(key)
            cache.after_attention(layer_idx, queries, outputs, scaling, None, summed, shared)
        shared.select()  # the selections the variants left pending, made at once


class RowBatch(Cache):
    """The caches of several rows — one (sample, variant) each, with its own policy, budget, length per layer and
    positions — stepped by one model forward of batch ``N``: the model's weights apply to all rows at once, and each
    row's keys/values go to its own cache, which the attention function attends, scores and evicts row by row at the
    row's own length (:func:`~kvbench.engine.attention.kvbench_attention`), as it would alone: no row is padded.
    ``store``: the stored rows' shelves for this step (``engine.rows_attention=stored``), each appended and attended
    in one call per layer; ``alone`` the batch places of the others (all rows without a store)."""

    def __init__(
        self,
        caches: list[EvictionCache],
        padded: bool = False,
        store: RowStore | None = None,
        alone: list[int] | None = None,
        span: int = 0,
    ) -> None:
        super().__init__(layers=[DynamicLayer() for _ in caches[0].layers])  # never filled: the model reads length 0
        self.alone = list(range(len(caches))) if alone is None else alone
        self.caches = [caches[place] for place in self.alone]
        #: ``engine.rows_attention=padded``: a decode step's rows attended by one padded call per layer
        #: (:func:`~kvbench.engine.attention.padded_outputs`), else each by its own
        self.padded = padded
        self.store = store
        self.shelves = [[] for _ in caches[0].layers] if store is None else store.stepping  # by layer
        self.attended: list[tuple[torch.Tensor, torch.Tensor]] = []  # this layer's, each row's cache
        self.everyone = len(self.alone) == len(caches)
        self.alone_places: torch.Tensor | None = None  # ``alone`` on the queries' device, made once a step
        self.longest = span  # the tokens of the longest row through this forward
        self.windows = caches[0].windows  # the model's: every row's

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append row ``r``'s keys/values ``[r:r+1]`` of ``[N,Hkv,q,D]`` to row ``r``'s cache (the stored rows' to their
        shelves); the rows' caches are attended by :meth:`rows` (what is returned here is not read)."""
        for shelf in self.shelves[layer_idx]:
            shelf.append(key_states, value_states)
        self.attended = [
            cache.update(key_states[place : place + 1], value_states[place : place + 1], layer_idx)
            for place, cache in zip(self.alone, self.caches)
        ]
        return key_states, value_states

    def span(self) -> int:
        """The tokens of the longest row through this forward, its own included."""
        return self.longest

    def window(self, layer_idx: int) -> int | None:
        """The sliding window every row's cache holds the layer through, or None."""
        return self.windows[layer_idx]

    def rows(self, layer_idx: int) -> list[tuple[EvictionCache, torch.Tensor, torch.Tensor]]:
        """Each row attended alone: its cache with the keys/values ``[1,Hc,T_r,D]`` it holds at ``layer_idx`` (after
        :meth:`update`), in the order of :meth:`alone_queries`."""
        attended, self.attended = self.attended, []
        return [(cache, keys, values) for cache, (keys, values) in zip(self.caches, attended)]

    def alone_queries(self, query: torch.Tensor) -> torch.Tensor:
        """The queries ``[N,Hq,q,D]`` of the rows attended alone."""
        return query if self.everyone else query[self.places(query)]

    def places(self, query: torch.Tensor) -> torch.Tensor:
        """The batch places of the rows attended alone, on the queries' device (made at the first layer)."""
        if self.alone_places is None:
            self.alone_places = torch.tensor(self.alone, dtype=torch.long, device=query.device)
        return self.alone_places

    def joined(self, layer_idx: int, query: torch.Tensor, outputs: list[torch.Tensor], scaling: float) -> torch.Tensor:
        """The batch's outputs ``[N,q,Hq,D]``: ``outputs`` of the rows attended alone and the shelves' own."""
        if self.everyone:
            return torch.cat(outputs)
        joined = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        if self.store is not None:  # what a stored row's next eviction reads
            self.store.saw(layer_idx, query)
        for shelf in self.shelves[layer_idx]:
            shelf.attend(query, scaling, joined)
        if outputs:
            joined.index_copy_(0, self.places(query), torch.cat(outputs))
        return joined
