"""The decode rows' entries held together (``engine.rows_attention=stored``): a step appends every stored row's token
with one scatter per layer and attends them with one SDPA call per layer, whatever the number of rows.

A row is stored where its decode steps only append and attend (:func:`storable`): no eviction while decoding (so no
scoring), no attending modifier, every head holding every key, the SDPA backend. Its kept entries move into a free
slot of a :class:`Shelf` — one buffer ``[S,Hc,C,D]`` per layer for the rows of one head count whose kept entries and
tokens to come fit ``C`` slots (``C`` a power of two: a row holds at most twice what it keeps) — and move back into
its own cache, with the tokens it decoded appended, when it leaves (:meth:`RowStore.release`): its outputs (sizes,
kept sets, statistics) are those of a row attended alone. The other rows of a step are attended each alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.engine.cache import EvictionCache
from kvbench.engine.layer import in_cache_heads


def storable(cache: EvictionCache) -> bool:
    """Whether a row's decode steps only append its token and attend (see the module's docstring)."""
    return (
        cache.attn_backend == "sdpa"
        and not cache.decode_evict
        and not cache.attending
        and all(layer.headwise is None for layer in cache.eviction_layers)
    )


class Shelf:
    """The rows of one cache-head count and capacity ``C``: per layer ``l`` ``keys``/``values [S,Hc,C,D]``, slot ``s``
    holding ``lengths[s][l]`` entries (its kept ones, then the tokens appended since ``kept[s][l]``: a layer budget
    may keep a length per layer)."""

    def __init__(self, like: EvictionCache, capacity: int) -> None:
        first = like.eviction_layers[0].keys
        self.heads, self.dim, self.capacity = first.shape[1], first.shape[-1], capacity
        self.repeat_layout, self.query_heads = like.repeat_layout, like.num_query_heads
        self.dtype, self.device = first.dtype, first.device
        self.num_layers = len(like.eviction_layers)
        self.head_index = torch.arange(self.heads, device=self.device)[None]  # [1,Hc]: every head of a slot
        self.keys: list[torch.Tensor] = [self._empty(0) for _ in range(self.num_layers)]
        self.values: list[torch.Tensor] = [self._empty(0) for _ in range(self.num_layers)]
        self.owners: list[EvictionCache | None] = []
        self.lengths: list[list[int]] = []
        self.kept: list[list[int]] = []
        self.first_positions: list[int] = []
        #: this step's: the stored rows' places in the batch [n], their slots [n], where each writes in each layer
        #: [n,L], the entries each slot holds after it [S,L] (an empty slot one) and the longest slot of each layer
        self.members = self.slots = self.write_at = self.held = torch.empty(0)
        self.longest: list[int] = []

    def _empty(self, slots: int) -> torch.Tensor:
        return torch.zeros(slots, self.heads, self.capacity, self.dim, dtype=self.dtype, device=self.device)

    def add(self, cache: EvictionCache, position: int) -> int:
        """Move ``cache``'s kept entries into a free slot (the row's first stored token at ``position``)."""
        if None not in self.owners:  # twice the slots: a step's appends stay one scatter
            added = max(1, len(self.owners))
            for index in range(self.num_layers):
                self.keys[index] = torch.cat([self.keys[index], self._empty(added)])
                self.values[index] = torch.cat([self.values[index], self._empty(added)])
            self.owners += [None] * added
            self.lengths += [[0] * self.num_layers for _ in range(added)]
            self.kept += [[0] * self.num_layers for _ in range(added)]
            self.first_positions += [0] * added
        slot = self.owners.index(None)
        for index, entries in enumerate(cache.eviction_layers):
            length = entries.get_seq_length()
            self.keys[index][slot, :, :length] = entries.keys[0]
            self.values[index][slot, :, :length] = entries.values[0]
            entries.keys, entries.values = entries.keys[:, :, :0].clone(), entries.values[:, :, :0].clone()  # held here
            self.lengths[slot][index] = self.kept[slot][index] = length
        self.owners[slot], self.first_positions[slot] = cache, position
        return slot

    def release(self, slot: int) -> None:
        """Move the slot's entries back into its row's cache, the tokens appended since it came in appended there."""
        cache = self.owners[slot]
        assert cache is not None  # a stored row's slot
        decoded = self.lengths[slot][0] - self.kept[slot][0]  # the same in every layer
        positions = torch.arange(self.first_positions[slot], self.first_positions[slot] + decoded)
        for index, entries in enumerate(cache.eviction_layers):
            kept, length = self.kept[slot][index], self.lengths[slot][index]
            keys, values = self.keys[index][slot : slot + 1], self.values[index][slot : slot + 1]
            entries.keys, entries.values = keys[:, :, :kept].clone(), values[:, :, :kept].clone()
            if length > kept:
                entries.append(keys[:, :, kept:length], values[:, :, kept:length], positions)
                cache.account(index)
        self.owners[slot], self.lengths[slot] = None, [0] * self.num_layers

    def begin_step(self, members: list[int], slots: list[int]) -> None:
        """This step's rows: batch places ``members`` in ``slots``, one token each."""
        device = self.device
        self.members = torch.tensor(members, device=device)
        self.slots = torch.tensor(slots, device=device)
        self.write_at = torch.tensor([self.lengths[slot] for slot in slots], device=device)  # [n,L]
        for slot in slots:
            self.lengths[slot] = [length + 1 for length in self.lengths[slot]]
        self.longest = [max(by_layer) for by_layer in zip(*self.lengths)]
        self.held = torch.tensor(self.lengths, device=device).clamp_(min=1)  # [S,L]: an empty slot sees one

    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the step's keys/values of the stored rows (``[N,Hkv,1,D]`` of the batch) at each row's length."""
        keys, values = in_cache_heads(
            key_states[self.members], value_states[self.members], self.query_heads, self.repeat_layout
        )  # [n,Hc,1,D]
        where = (self.slots[:, None], self.head_index, self.write_at[:, layer, None])  # [n,Hc] each
        self.keys[layer].index_put_(where, keys[:, :, 0])
        self.values[layer].index_put_(where, values[:, :, 0])

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The stored rows' attention outputs ``[n,1,Hq,D]`` for the batch's single queries ``query [N,Hq,1,D]``:
        one SDPA call over every slot (an empty slot's output is dropped)."""
        queries = query.new_zeros(len(self.owners), *query.shape[1:]).index_copy_(0, self.slots, query[self.members])
        longest = self.longest[layer]
        visible = torch.arange(longest, device=self.device) < self.held[:, layer, None]  # [S,T]
        output = F.scaled_dot_product_attention(
            queries,
            self.keys[layer][:, :, :longest],
            self.values[layer][:, :, :longest],
            attn_mask=visible[:, None, None],
            scale=scaling,
            enable_gqa=query.shape[1] != self.heads,
        )  # [S,Hq,1,D]
        return output.index_select(0, self.slots).transpose(1, 2)


class RowStore:
    """The stored rows of a decode (:func:`~kvbench.engine.rows.finished_rows`), on shelves by head count and
    capacity."""

    def __init__(self) -> None:
        self.shelves: dict[tuple[int, int], Shelf] = {}
        self.places: dict[int, tuple[Shelf, int]] = {}  # id(cache) → its shelf and slot
        self.stepping: list[Shelf] = []

    def begin_step(self, caches: list[EvictionCache], positions: list[int], to_come: list[int]) -> list[int]:
        """Store the step's storable rows not stored yet (``to_come``: the tokens each may still append) and declare
        the step; returns the batch places of the rows attended each alone."""
        by_shelf: dict[int, tuple[Shelf, list[int], list[int]]] = {}
        alone = []
        for place, (cache, position, more) in enumerate(zip(caches, positions, to_come)):
            if id(cache) not in self.places and storable(cache):
                needed = max(layer.get_seq_length() for layer in cache.eviction_layers) + more
                capacity = 1 << max(needed - 1, 1).bit_length()
                key = (cache.cache_heads, capacity)
                if key not in self.shelves:
                    self.shelves[key] = Shelf(cache, capacity)
                shelf = self.shelves[key]
                self.places[id(cache)] = shelf, shelf.add(cache, position)
            if id(cache) not in self.places:
                alone.append(place)
                continue
            shelf, slot = self.places[id(cache)]
            _, members, slots = by_shelf.setdefault(id(shelf), (shelf, [], []))
            members.append(place)
            slots.append(slot)
        self.stepping = []
        for shelf, members, slots in by_shelf.values():
            shelf.begin_step(members, slots)
            self.stepping.append(shelf)
        return alone

    def release(self, cache: EvictionCache) -> None:
        """Move a leaving row's entries back into its cache (nothing where it was not stored); a shelf left empty is
        let go (a long sweep's rows come and go: its shelves are those of the rows in flight)."""
        if id(cache) in self.places:
            shelf, slot = self.places.pop(id(cache))
            shelf.release(slot)
            if all(owner is None for owner in shelf.owners):
                self.shelves = {key: kept for key, kept in self.shelves.items() if kept is not shelf}
