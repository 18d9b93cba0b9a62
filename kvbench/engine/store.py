"""The decode rows' entries held together (``engine.rows_attention=stored``): a step appends every stored row's token
with one scatter per shelf of a layer and attends them with one SDPA call per shelf, whatever the number of rows.

A row is stored where its decode steps only append and attend (:func:`storable`): no eviction while decoding (so no
scoring), no attending modifier, every head holding every key, the SDPA backend. Each of its layers' kept entries
moves into a free slot of a :class:`Shelf` of that layer — one buffer ``[S,Hc,C,D]`` for the rows of one head count
whose kept entries and tokens to come fit ``C`` slots (:func:`capacity_class`: at most an eighth to spare; a layer
budget's rows hold a length per layer, each on its own layer's shelf) — and moves back into its own cache, with the
tokens it decoded appended, when it leaves (:meth:`RowStore.release`): its outputs (sizes, kept sets, statistics) are
those of a row attended alone. The other rows of a step are attended each alone.

Memory: a shelf grows by exactly the rows arriving (into its free slots first) and is copied without its free slots
once they are more than a sixteenth of it; an empty one is let go. :attr:`RowStore.peak_bytes` is what the shelves
held at their largest, beside :attr:`RowStore.reserved_at_peak`, the entries the rows then reserved (kept and to come).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def capacity_class(needed: int) -> int:
    """The slots a row needing ``needed`` is given: ``needed`` rounded up to an eighth of its octave (``< 12.5 %``
    spare; exact up to 16), so that a layer's rows share a few shelves."""
    step = 1 << max(0, (needed - 1).bit_length() - 4)
    return -(-needed // step) * step


@dataclass(eq=False)
class Stored:
    """A stored row: its cache, the position of its first stored token, each layer's kept entries and slot."""

    cache: EvictionCache
    first_position: int
    kept: list[int]
    reserved: int  # the bytes of the entries it may hold, every layer's (kept and to come)
    slots: dict[int, tuple[Shelf, int]] = field(default_factory=dict)  # by layer


class Shelf:
    """One layer's rows of one cache-head count and capacity ``C``: ``keys``/``values [S,Hc,C,D]``, slot ``s`` holding
    ``lengths[s]`` entries (its row's kept ones, then the tokens appended since); ``lengths`` on the host."""

    def __init__(self, like: EvictionCache, layer: int, capacity: int) -> None:
        first = like.eviction_layers[layer].keys
        self.layer, self.heads, self.dim, self.capacity = layer, first.shape[1], first.shape[-1], capacity
        self.repeat_layout, self.query_heads = like.repeat_layout, like.num_query_heads
        self.keys, self.values = self._empty(first, 0), self._empty(first, 0)
        self.owners: list[Stored | None] = []
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.head_index = torch.arange(self.heads, device=first.device)[None]  # [1,Hc]: every head of a slot
        #: this step's: the stored rows' places in the batch [n], their slots [n], where each writes [n], the entries
        #: each slot holds after it [S] (an empty slot one) and the longest slot
        self.members = self.slots = self.write_at = self.held = torch.empty(0)
        self.longest = 0

    def _empty(self, like: torch.Tensor, slots: int) -> torch.Tensor:
        return like.new_zeros(slots, self.heads, self.capacity, self.dim)

    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def place(self, owners: list[Stored]) -> None:
        """Move the layer's kept entries of ``owners``' caches into free slots, the shelf grown once by the missing."""
        free = [slot for slot, owner in enumerate(self.owners) if owner is None]
        if (missing := len(owners) - len(free)) > 0:
            free += range(len(self.owners), len(self.owners) + missing)
            self.keys = torch.cat([self.keys, self._empty(self.keys, missing)])
            self.values = torch.cat([self.values, self._empty(self.values, missing)])
            self.owners += [None] * missing
            self.lengths = torch.cat([self.lengths, torch.zeros(missing, dtype=torch.long)])
        for slot, owner in zip(free, owners):
            entries = owner.cache.eviction_layers[self.layer]
            length = entries.get_seq_length()
            self.keys[slot, :, :length] = entries.keys[0]
            self.values[slot, :, :length] = entries.values[0]
            entries.keys, entries.values = entries.keys[:, :, :0].clone(), entries.values[:, :, :0].clone()  # held here
            self.lengths[slot], self.owners[slot] = length, owner
            owner.slots[self.layer] = (self, slot)

    def take(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Free ``slot``; its entries ``[1,Hc,length,D]`` (views of the shelf: copy what is kept)."""
        length = int(self.lengths[slot])
        self.owners[slot], self.lengths[slot] = None, 0
        return self.keys[slot : slot + 1, :, :length], self.values[slot : slot + 1, :, :length]

    def compact(self) -> bool:
        """Copy the shelf without its free slots where they are more than a sixteenth of it; whether it did."""
        held = [slot for slot, owner in enumerate(self.owners) if owner is not None]
        if len(self.owners) - len(held) <= len(self.owners) // 16:
            return False
        index = torch.tensor(held, device=self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.lengths, self.owners = self.lengths[held], [self.owners[slot] for slot in held]
        for slot, owner in enumerate(self.owners):
            assert owner is not None  # a held slot
            owner.slots[self.layer] = (self, slot)
        return True

    def begin_step(self, members: torch.Tensor, slots: torch.Tensor, on_host: torch.Tensor) -> None:
        """This step's rows: batch places ``members [n]`` in ``slots [n]`` (``on_host``: the same on the host), one
        token each."""
        device = self.keys.device
        self.members, self.slots = members, slots
        self.write_at = self.lengths[on_host].to(device)
        self.lengths[on_host] += 1
        self.longest = int(self.lengths.max())
        self.held = self.lengths.clamp(min=1).to(device)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the step's keys/values of the stored rows (``[N,Hkv,1,D]`` of the batch) at each row's length."""
        keys, values = in_cache_heads(
            key_states[self.members], value_states[self.members], self.query_heads, self.repeat_layout
        )  # [n,Hc,1,D]
        where = (self.slots[:, None], self.head_index, self.write_at[:, None])  # [n,Hc] each
        self.keys.index_put_(where, keys[:, :, 0])
        self.values.index_put_(where, values[:, :, 0])

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The stored rows' attention outputs ``[n,1,Hq,D]`` for the batch's single queries ``query [N,Hq,1,D]``:
        one SDPA call over every slot (an empty slot's output is dropped)."""
        queries = query.new_zeros(len(self.owners), *query.shape[1:]).index_copy_(0, self.slots, query[self.members])
        visible = torch.arange(self.longest, device=query.device) < self.held[:, None]  # [S,T]
        output = F.scaled_dot_product_attention(
            queries,
            self.keys[:, :, : self.longest],
            self.values[:, :, : self.longest],
            attn_mask=visible[:, None, None],
            scale=scaling,
            enable_gqa=query.shape[1] != self.heads,
        )  # [S,Hq,1,D]
        return output.index_select(0, self.slots).transpose(1, 2)


#: a shelf stepped: its rows' batch places and slots on its device, the slots on the host
Stepping = tuple[Shelf, torch.Tensor, torch.Tensor, torch.Tensor]


class RowStore:
    """The stored rows of a decode (:func:`~kvbench.engine.rows.finished_rows`), on shelves by layer, head count and
    capacity."""

    def __init__(self) -> None:
        self.shelves: dict[tuple[int, int, int], Shelf] = {}
        self.places: dict[int, Stored] = {}  # id(cache) → the row stored
        self.stepping: list[list[Shelf]] = []  # by layer, this step's shelves
        #: the step's rows (by id; -1 where attended alone) and by layer each shelf with its rows' batch places and
        #: slots (on the device, and on the host): made again when the rows or their slots change
        self.layout: tuple[tuple[int, ...], list[list[Stepping]]] | None = None
        self.reserved = 0  # the bytes the rows reserve (Stored.reserved) now
        self.peak_bytes = self.reserved_at_peak = 0

    def begin_step(self, caches: list[EvictionCache], positions: list[int], to_come: list[int]) -> list[int]:
        """Store the step's storable rows not stored yet (``to_come``: the tokens each may still append) and declare
        the step; returns the batch places of the rows attended each alone."""
        arriving: dict[tuple[int, int, int], list[Stored]] = {}
        for cache, position, more in zip(caches, positions, to_come):
            if id(cache) in self.places or not storable(cache):
                continue
            kept = [layer.get_seq_length() for layer in cache.eviction_layers]
            keys = cache.eviction_layers[0].keys  # [1,Hc,T,D]
            entry = 2 * keys[0, :, 0].numel() * keys.element_size()  # a token's keys and values in one layer
            row = Stored(cache, position, kept, (sum(kept) + more * len(kept)) * entry)
            for layer, length in enumerate(kept):
                key = (layer, cache.cache_heads, capacity_class(length + more))
                if key not in self.shelves:
                    self.shelves[key] = Shelf(cache, layer, key[2])
                arriving.setdefault(key, []).append(row)
            self.places[id(cache)] = row
            self.reserved += row.reserved
        for key, rows in arriving.items():
            self.shelves[key].place(rows)
        if any([shelf.compact() for shelf in self.shelves.values()]):
            self.layout = None
        members = tuple(id(cache) if id(cache) in self.places else -1 for cache in caches)
        if self.layout is None or self.layout[0] != members:
            self.layout = members, self._layout(caches, len(caches[0].layers))
        self.stepping = []
        for by_shelf in self.layout[1]:
            for shelf, *step in by_shelf:
                shelf.begin_step(*step)
            self.stepping.append([shelf for shelf, *_ in by_shelf])
        if (held := sum(shelf.bytes() for shelf in self.shelves.values())) > self.peak_bytes:
            self.peak_bytes, self.reserved_at_peak = held, self.reserved
        return [place for place, cache in enumerate(caches) if id(cache) not in self.places]

    def _layout(self, caches: list[EvictionCache], layers: int) -> list[list[Stepping]]:
        """By layer, each shelf with the batch places and slots of its rows in this step."""
        by_layer: list[dict[int, tuple[Shelf, list[int], list[int]]]] = [{} for _ in range(layers)]
        for place, cache in enumerate(caches):
            if (row := self.places.get(id(cache))) is not None:
                for layer, (shelf, slot) in row.slots.items():
                    _, places, slots = by_layer[layer].setdefault(id(shelf), (shelf, [], []))
                    places.append(place)
                    slots.append(slot)
        return [
            [
                (shelf, torch.tensor(places, device=shelf.keys.device), on_host.to(shelf.keys.device), on_host)
                for shelf, places, slots in shelves.values()
                for on_host in [torch.tensor(slots)]
            ]
            for shelves in by_layer
        ]

    def release(self, cache: EvictionCache) -> None:
        """Move a leaving row's entries back into its cache, the tokens it decoded appended (nothing where it was not
        stored); a shelf left empty is let go (a long sweep's rows come and go: its shelves are those in flight)."""
        row = self.places.pop(id(cache), None)
        if row is None:
            return
        self.layout = None
        self.reserved -= row.reserved
        for index, (entries, kept) in enumerate(zip(cache.eviction_layers, row.kept)):
            shelf, slot = row.slots[index]
            keys, values = shelf.take(slot)
            entries.keys, entries.values = keys[:, :, :kept].clone(), values[:, :, :kept].clone()
            if (decoded := keys.shape[2] - kept) > 0:
                positions = torch.arange(row.first_position, row.first_position + decoded)
                entries.append(keys[:, :, kept:], values[:, :, kept:], positions)
                cache.account(index)
            if all(owner is None for owner in shelf.owners):
                del self.shelves[(index, shelf.heads, shelf.capacity)]
