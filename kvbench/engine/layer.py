"""One layer of the budgeted cache: per cache head the kept keys/values, their absolute positions and the scoring
state (:class:`EvictionLayer`); the entries a head-wise eviction keeps, a length per head, are
:class:`~kvbench.engine.entries.HeadwiseEntries`. The cache that evicts its layers is :mod:`kvbench.engine.cache`."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvbench.engine.entries import HeadwiseEntries, PrunedKeys
from kvbench.engine.kivi import Kivi, KiviEntries
from kvbench.engine.selection import dropped_slots
from kvbench.engine.sharing import SharedForward
from kvbench.errors import KVBenchError
from kvbench.policies.base import AttentionStats, Modifier
from kvbench.policies.context import Evicted, take_slots

#: a single-token append to a layer with no room left grows its storage by this many slots: decoding copies the
#: layer once every ``APPEND_SPARE`` tokens rather than at every token (transformers' ``DynamicLayer`` concatenates)
APPEND_SPARE = 32


def appended(held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``held [B,H,T,D]`` followed by ``new [B,H,q,D]``: written in place after ``held`` where ``held`` is the first
    ``T`` slots of a ``[B,H,C,D]`` storage with room for ``q`` more (one this function made: a layer's other tensors are
    their own storage, ``C = T``); else copied into a new storage, ``APPEND_SPARE`` slots to spare after a single
    token. A layer's first forward of several tokens holds ``new`` itself where it is contiguous (no copy: the variants
    of a shared prefill hold one tensor until each evicts, :class:`~kvbench.engine.batches.SharedPrefill`); it has
    no room, so nothing is ever written into it. (Inference tensors keep no view base, so the room is read from the
    strides.)"""
    batch, heads, added, dim = new.shape
    length = held.shape[2] if held.dim() == 4 else 0
    if length == 0 and added > 1 and new.is_contiguous():
        return new
    room = held.stride(1) // dim if length and held.stride(-1) == 1 and held.stride(2) == dim else 0
    if room >= length + added and held.stride(0) == heads * room * dim and held.storage_offset() == 0:
        grown = held.as_strided((batch, heads, length + added, dim), held.stride())
        grown[:, :, length:] = new
        return grown
    store = new.new_empty(batch, heads, length + added + (APPEND_SPARE if added == 1 else 0), dim)
    if length:
        store[:, :, :length] = held
    store[:, :, length : length + added] = new
    return store[:, :, : length + added]


class EvictionLayer(DynamicLayer):
    """One layer's cache: ``keys``/``values [B,Hc,T,D]``, ``positions [B,Hc,T]`` and scoring state.

    ``Hc`` is the number of KV heads, or of query heads in the KV-repeated layout. ``running_score [B,Hc,T]``
    holds the running score of running policies (H2O); ``recent_queries [B,Hq,W,D]`` the last
    ``W`` queries for window policies (SnapKV's observation window, TOVA's last query) and layer
    preferences; ``last_query [B,Hq,D]`` the newest query of the last forward that could evict (CaliDrop's initial
    calibration query); ``ranking [B,Hc,T]`` the scores of the last eviction (re-used when cascading shrinks the layer
    again);
    ``received [B,Hc,T]`` the ``reconstruction`` statistic of the slots reconstructed so far.

    After a head-wise eviction (:meth:`keep_per_head`) the kept entries are ``headwise`` (:class:`HeadwiseEntries`,
    a length per head) and ``keys``/``values``/``positions`` hold only the tokens appended since, the same for
    every head. In a quantised cache (``cache.quant``, :meth:`roll`) the first keys and values are ``quantized``
    (:class:`~kvbench.engine.kivi.KiviEntries`) and ``keys``/``values`` hold the rest in full precision, not as
    many keys as values; ``positions`` are every token's. Once its key channels are pruned (:meth:`prune_channels`)
    the prompt's keys are ``pruned`` (:class:`PrunedKeys`) and ``keys`` those appended since.
    """

    # DynamicLayer's keys/values are None until the first ``append`` initialises them; an EvictionLayer is only
    # read once it holds tokens (EvictionCache.update appends before the attention reads the layer). ``positions``
    # and the scoring state stay Optional: they are checked where they are read.
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.running_score: torch.Tensor | None = None
        self.recent_queries: torch.Tensor | None = None
        self.recent_query_positions: torch.Tensor | None = None
        self.last_query: torch.Tensor | None = None
        self.ranking: torch.Tensor | None = None
        self.received: torch.Tensor | None = None
        self.modifier_state: dict[str, Any] = {}
        self.headwise: HeadwiseEntries | None = None
        #: after a head-wise eviction, what :meth:`attended` returned last: the padded entries followed by the tokens
        #: appended since (grown in place by the next), for the entries and the appended storage it was made from
        self.layout: tuple[HeadwiseEntries, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: the slots of ``keys``/``values`` that a cascade's evictions keep, gathered once it ends
        #: (:meth:`keep` with ``defer``, :meth:`gather_deferred`); None: ``keys``/``values`` are the layer's entries
        self.deferred_slots: torch.Tensor | None = None
        #: the positions and ranking ``[B,Hc,T]`` of the entries those evictions select from (:meth:`dropped_deferred`)
        self.deferred_from: tuple[torch.Tensor, torch.Tensor] | None = None
        #: the slots ``[1,Hc,T]`` (True = kept) that a cascade's head-wise evictions keep, packed once it ends
        #: (:meth:`keep_per_head` with ``defer``); None: no head-wise eviction pending
        self.deferred_heads: torch.Tensor | None = None
        self.deferred_entries = 0  # how many they are (read back once, when kept)
        #: the entries a quantised cache holds quantised (:meth:`roll`), or None
        self.quantized: KiviEntries | None = None
        #: the keys held in part of their channels (:meth:`prune_channels`), or None
        self.pruned: PrunedKeys | None = None
        self.peak_tokens = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append this forward's tokens (``positions [q]``; in place where the storage has room, :func:`appended`) and
        grow the per-token state to match."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        # a cascade's gathers and packing end with its forward (EvictionCache.after_attention)
        assert self.deferred_slots is None and self.deferred_heads is None
        self.keys, self.values = appended(self.keys, keys), appended(self.values, values)
        batch, heads, new_tokens, _ = keys.shape
        new_positions = positions.to(keys.device).expand(batch, heads, new_tokens)
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], -1)
        if self.running_score is not None:
            zeros = self.running_score.new_zeros(batch, heads, new_tokens)
            self.running_score = torch.cat([self.running_score, zeros], dim=-1)
        self.ranking = None
        self.peak_tokens = max(self.peak_tokens, self.tokens_per_head())

    def get_seq_length(self) -> int:
        """The slots the layer holds (after a head-wise eviction, those appended since; quantised, every key)."""
        if self.deferred_slots is not None:
            return self.deferred_slots.shape[-1]
        held = super().get_seq_length() + (0 if self.pruned is None else self.pruned.keys.shape[2])
        return held + (0 if self.quantized is None else self.quantized.tokens()[0])

    def prune_channels(self, channels: torch.Tensor) -> None:
        """Hold the keys in the channels ``channels [B,Hc,D']`` only (each head's, ascending), once the prompt is read;
        keys appended later keep every channel."""
        assert self.headwise is None and self.deferred_slots is None and self.quantized is None and self.pruned is None
        index = channels[:, :, None].expand(-1, -1, self.keys.shape[2], -1)  # [B,Hc,T,D']
        self.pruned = PrunedKeys(self.keys.gather(-1, index), channels, self.keys.shape[-1])
        self.keys = self.keys[:, :, :0].clone()

    def roll(self, kivi: Kivi) -> None:
        """Quantise the entries past ``kivi``'s full-precision residual (:meth:`Kivi.roll`): the prompt's once it
        is read, then at every decode step those the last step pushed past it."""
        assert self.headwise is None and self.deferred_slots is None  # a quantised cache's layers evict no more
        self.quantized = KiviEntries() if self.quantized is None else self.quantized
        self.keys, self.values = kivi.roll(self.quantized, self.keys, self.values)

    def tokens_per_head(self) -> int:
        """The entries held per cache head (on average, after a head-wise eviction)."""
        if self.deferred_heads is not None:
            return self.deferred_entries // self.deferred_heads.shape[1]
        held = 0 if self.headwise is None else sum(self.headwise.counts) // self.headwise.heads
        return held + self.get_seq_length()

    def held_bytes(self, tokens: int | None = None) -> int:
        """The bytes of the keys and values held (``tokens`` of them per cache head where given)."""
        if self.quantized is not None or self.pruned is not None:  # the quantised or pruned entries, then the rest
            full = (self.keys.numel() + self.values.numel()) * self.keys.element_size()
            held = self.quantized.bytes() if self.quantized is not None else 0
            return held + (self.pruned.bytes() if self.pruned is not None else 0) + full
        batch, heads, _, dim = self.keys.shape
        slots = self.keys.shape[2] if self.deferred_slots is None else self.deferred_slots.shape[-1]
        held = batch * heads * (slots if tokens is None else tokens) * dim
        if self.deferred_heads is not None:  # the entries the pending head-wise evictions keep
            held = self.deferred_entries * dim
        entries = held + (0 if self.headwise is None else self.headwise.keys.numel())
        return 2 * entries * self.keys.element_size()

    def kept_by_head(self) -> list[torch.Tensor]:
        """Each cache head's positions (batch 0), in order."""
        assert self.positions is not None
        if self.headwise is None:
            return list(self.positions[0])
        return [torch.cat([own, self.positions[0, head]]) for head, own in enumerate(self.headwise.by_head())]

    def held_per_head(self) -> list[int]:
        """How many positions each cache head holds (batch 0): :meth:`kept_by_head`'s lengths, from the host."""
        assert self.positions is not None
        appended = self.positions.shape[2]
        if self.headwise is None:
            return [appended] * self.positions.shape[1]
        return [own + appended for own in self.headwise.counts]

    def attended(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The keys and values ``[B,Hc,T,D]`` a forward attends to and which of them each head holds ``[Hc,T]`` (None:
        all): after a head-wise eviction its entries padded to the longest head, then the tokens appended since;
        quantised, the quantised entries dequantised, then the rest (a working copy, not held)."""
        if self.quantized is not None:
            return *self.quantized.attended(self.keys, self.values), None
        if self.pruned is not None:
            return torch.cat([self.pruned.attended(), self.keys], dim=2), self.values, None
        if self.headwise is None:
            return self.keys, self.values, None
        entries, tokens = self.headwise, self.get_seq_length()
        last = self.layout  # grown if made from these entries and this appended storage (grown in place since)
        if (
            last is not None
            and last[0] is entries
            and last[1].data_ptr() == self.keys.data_ptr()
            and last[2].shape[2] <= entries.longest + tokens
        ):
            _, _, keys, values = last
            included = keys.shape[2] - entries.longest
        else:
            keys, values, included = entries.padded(entries.keys), entries.padded(entries.values), 0  # [1,Hc,longest,D]
        keys = appended(keys, self.keys[:, :, included:tokens])
        values = appended(values, self.values[:, :, included:tokens])
        self.layout = (entries, self.keys, keys, values)  # holding self.keys keeps its address its own
        appended_mask = torch.ones(entries.heads, tokens, dtype=torch.bool, device=keys.device)
        return keys, values, torch.cat([entries.mask(), appended_mask], dim=-1)

    def truncate(self, length: int) -> None:
        """Drop every slot after the first ``length`` (a reconstruction forward's own tokens), freeing them (a copy:
        a view would hold the longer tensors)."""
        assert self.positions is not None
        self.keys, self.values = self.keys[:, :, :length].clone(), self.values[:, :, :length].clone()
        self.positions = self.positions[..., :length]

    def slide(self, window: int) -> None:
        """Hold only the last ``window - 1`` tokens, those the next query of a layer the model attends through a sliding
        ``window`` reads (transformers' ``DynamicSlidingWindowLayer``); copied, so that the longer tensors are freed."""
        assert self.positions is not None and self.headwise is None  # a sliding layer is never evicted by a policy
        if self.get_seq_length() >= window:
            start = self.get_seq_length() - window + 1
            self.keys, self.values = self.keys[:, :, start:].clone(), self.values[:, :, start:].clone()
            self.positions = self.positions[..., start:]

    def remember_queries(
        self,
        queries: torch.Tensor,
        positions: torch.Tensor,
        window: int,
        shared: SharedForward | None = None,
    ) -> None:
        """Keep the last ``window`` queries ``[B,Hq,W,D]`` (and their positions), copied so that the
        forward's full query tensor is not held; in a shared prefill (``shared``) the variants of one window hold one
        copy (Expected Attention's window is the whole prompt)."""
        if self.recent_queries is None and shared is not None:
            if window not in shared.queries:
                shared.queries[window] = queries[:, :, -window:].clone(), positions[-window:].clone()
            self.recent_queries, self.recent_query_positions = shared.queries[window]
            return
        if self.recent_queries is not None:
            assert self.recent_query_positions is not None  # set together with recent_queries
            queries = torch.cat([self.recent_queries, queries], dim=2)
            positions = torch.cat([self.recent_query_positions, positions])
        self.recent_queries = queries[:, :, -window:].clone()
        self.recent_query_positions = positions[-window:].clone()

    def keep_last_queries(self, count: int) -> None:
        """Hold only the last ``count`` of the recent queries (copies: the longer tensors are freed), or none."""
        if count == 0 or self.recent_queries is None or self.recent_query_positions is None:
            self.recent_queries = self.recent_query_positions = None
            return
        self.recent_queries = self.recent_queries[:, :, -count:].clone()
        self.recent_query_positions = self.recent_query_positions[-count:].clone()

    def state_of(self, modifier: Modifier) -> Any:
        """The attending modifier's state in this layer, created on first use."""
        if modifier.name not in self.modifier_state:
            self.modifier_state[modifier.name] = modifier.new_state()
        return self.modifier_state[modifier.name]

    def window_stats(self, window: int, scaling: float) -> AttentionStats:
        """The float32 attention statistics of the last ``window`` recorded queries over this layer's cache."""
        assert self.positions is not None and self.deferred_slots is None  # a cascade stage reads its own layer
        assert self.recent_queries is not None and self.recent_query_positions is not None
        return AttentionStats(
            self.recent_queries[:, :, -window:],  # [B,Hq,W,D]
            self.keys,
            self.values,
            self.recent_query_positions[-window:],
            self.positions,
            scaling,
        )

    def keep(self, kept: torch.Tensor, defer: bool = False, gathered: tuple[torch.Tensor, ...] | None = None) -> None:
        """Gather the kept slots ``kept [B,Hc,K]`` (sorted) into new, smaller tensors; with ``defer`` (a cascade, which
        re-evicts a layer at every later stage) the keys/values only once the cascade ends (:meth:`gather_deferred`),
        from the slots every eviction kept: the same entries, gathered once. ``gathered``: the keys, values and
        positions at ``kept`` already gathered from the same entries, and the ranking there
        (:meth:`~kvbench.engine.sharing.SharedForward.select`)."""
        assert self.positions is not None
        if self.running_score is not None:
            self.running_score = self.running_score.gather(2, kept)
        if gathered is not None:
            assert self.deferred_slots is None and not defer  # one selection of the entries as they are
            self.keys, self.values, self.positions, self.ranking = gathered
            return
        if defer and self.deferred_slots is None and self.ranking is not None:
            self.deferred_from = (self.positions, self.ranking)
        if self.ranking is not None:
            self.ranking = self.ranking.gather(2, kept)
        self.positions = self.positions.gather(2, kept)
        self.deferred_slots = kept if self.deferred_slots is None else self.deferred_slots.gather(2, kept)
        if not defer:
            self.gather_deferred()

    def gather_deferred(self) -> None:
        """Gather the keys/values that deferred evictions kept (:meth:`keep`), and pack those that deferred head-wise
        evictions kept (:meth:`keep_per_head`)."""
        if self.deferred_slots is not None:
            slots, self.deferred_slots, self.deferred_from = self.deferred_slots, None, None
            self.keys, self.values = take_slots(slots, self.keys, self.values)
        if self.deferred_heads is not None:
            assert self.ranking is not None  # kept with them
            kept, self.deferred_heads = self.deferred_heads, None
            self.keep_per_head(kept, self.ranking)

    def keep_per_head(
        self, kept: torch.Tensor, ranking: torch.Tensor, defer: bool = False, counts: list[int] | None = None
    ) -> None:
        """Keep the slots ``kept [1,Hc,T]`` (True = kept; any number per head), ranked ``ranking [1,Hc,T]``, as
        :class:`HeadwiseEntries`, freeing the rest; the layer then appends to empty tensors. With ``defer`` (a
        cascade's stages, each of which may shrink the layer's heads again) the slots and ranking are only held, and
        packed once the cascade ends (:meth:`gather_deferred`): the layer keeps its slots and the next stage ranks the
        held ones (:meth:`held_heads`), as it would rank them packed and laid out again (:meth:`unpack`). ``counts``:
        how many each head keeps, where known on the host (else read back)."""
        assert self.positions is not None
        if kept.shape[0] != 1:
            raise KVBenchError("a head-wise eviction keeps one sequence per cache (batch 1)")
        if defer:
            self.deferred_heads, self.ranking, self.deferred_entries = kept, ranking.float(), int(kept.sum())
            return
        self.gather_deferred()
        self.headwise = HeadwiseEntries.packed(self.keys, self.values, self.positions, ranking.float(), kept, counts)
        self.keys, self.values = self.keys[:, :, :0].clone(), self.values[:, :, :0].clone()
        self.positions = self.positions[..., :0].clone()
        self.running_score = self.ranking = None

    def held_heads(self, sinks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's ranking ``[1,Hc,T]`` for another head-wise eviction in this forward and which slots each head
        holds (None: all): those a deferred head-wise eviction kept, the others ranked −inf; else a packed layer's
        laid out again (:meth:`unpack`); else the ranking as it is."""
        if self.deferred_heads is not None:
            held, self.deferred_heads = self.deferred_heads, None
            assert self.ranking is not None  # kept with them
            return self.ranking.masked_fill(~held, -torch.inf), held
        unpacked = None if self.headwise is None else self.unpack(sinks)
        assert self.ranking is not None  # ranked at its own stage of this forward (or laid out again)
        return self.ranking, unpacked

    def unpack(self, sinks: int) -> torch.Tensor:
        """Put the head-wise entries (with nothing appended since) back in one layout with their ranking, for another
        eviction (:meth:`HeadwiseEntries.unpacked`); returns which slots each head holds ``[1,Hc,L]``."""
        assert self.headwise is not None and self.get_seq_length() == 0  # re-evicted in the forward that kept them
        self.keys, self.values, self.positions, self.ranking, held = self.headwise.unpacked(sinks)
        self.headwise = self.layout = None
        return held

    def dropped_by(self, kept: torch.Tensor) -> Evicted:
        """The entries that keeping ``kept [B,Hc,K]`` evicts, in position order, scored by ``ranking``."""
        assert self.positions is not None and self.ranking is not None
        return dropped(self.keys, self.values, self.positions, self.ranking, kept, self.deferred_slots)

    def dropped_deferred(self) -> Evicted | None:
        """The entries a cascade's deferred evictions (:meth:`keep` with ``defer``) drop, of those they selected from,
        in position order; None where none is deferred."""
        if self.deferred_slots is None:
            return None
        assert self.deferred_from is not None  # kept by the first deferred eviction (a ranked one)
        return dropped(self.keys, self.values, *self.deferred_from, self.deferred_slots, None)


def dropped(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    ranking: torch.Tensor,
    kept: torch.Tensor,
    slots: torch.Tensor | None,
) -> Evicted:
    """The entries of ``positions``/``ranking [B,Hc,T]`` that keeping ``kept [B,Hc,K]`` drops, in slot order, their
    keys and values at ``slots`` of ``keys``/``values`` where these are not gathered yet (a deferred eviction's)."""
    index = dropped_slots(kept, positions.shape[-1])
    return Evicted.taken(keys, values, positions, ranking, index, None if slots is None else slots.gather(2, index))


def in_cache_heads(
    keys: torch.Tensor, values: torch.Tensor, num_query_heads: int, repeat: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's keys/values ``[B,Hkv,q,D]`` in the cache's heads: repeated to the query heads in the repeat
    layout (``policy.gqa=repeat``), else as they are."""
    if not repeat:
        return keys, values
    group = num_query_heads // keys.shape[1]
    return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
