"""The decode rows' entries held together (``engine.rows_attention=stored``): a step appends every stored row's token
with one scatter per shelf of a layer and attends them with one call per shelf, whatever the number of rows; a layer has
one shelf per head layout, attending modifiers' settings and running sums (one for rows that only append and attend).

A row is stored where its decode steps only append and attend (:func:`storable`): no attending modifier but those that
attend with the others' on a shelf (``Modifier.stores``: SLAKE, CaliDrop, each unit's state held on the shelf beside its
entries), no sliding-window layer (which drops its oldest token at each step), no learned sinks, the SDPA backend. A row
that evicts while it decodes every few tokens (``engine.decode_interval``) is stored between its evictions where its
ranking reads the keys, a window of queries or H2O's running sums (:func:`stored_between_evictions`): it leaves the
store before a step that evicts, which it takes alone, and takes back the queries of its stored steps that its window
reads (:meth:`RowStore.saw` keeps each step's, not copied) and the running scores its shelf added
(:meth:`Shelf.add_sums`); a non-causal running score, an attending modifier, a cascading layer budget or a head-wise
share keeps it alone. The unit is one cache head of one row (a ``(row, head)``): each of a row's layers moves its heads'
kept entries into regions of that layer's :class:`Shelf`, one flat buffer ``[P,D]`` where a unit's region holds its kept
entries and the tokens it may append (:func:`capacity_class`: under an eighth to spare), so a layer budget's lengths per
layer and a head-wise eviction's lengths per head (AdaKV) are held without padding — and moves back into the row's own
cache, with the tokens it decoded appended, when the row leaves to evict (:meth:`RowStore.release`); a finished row
leaves its entries behind, its sizes and statistics as its own cache would hold them (:meth:`RowStore.let_go`): its
outputs are those of a row attended alone. A unit is attended by the query heads that read its cache head
(``Hq / Hc`` of them; one in the repeat layout) over its own region: by :mod:`kvbench.kernels.decode`'s kernel on CUDA,
by one SDPA call over the regions gathered to the longest elsewhere. Where modifiers attend (their state is the shelf's,
every unit attended by one SDPA call), on CUDA a shelf holds every capacity, its regions gathered to the longest each
step, and elsewhere one capacity, viewed ``[U,C,D]`` without a copy (:data:`~kvbench.engine.shelf.MODIFIER_SHELVES`).
The other rows of a step are attended each alone.

Memory: a shelf grows by exactly the regions arriving (into free regions of their capacity first) and is copied without
its free regions once they are more than a sixteenth of it; an empty one is let go. :attr:`RowStore.peak_bytes` is what
the shelves held at their largest, beside :attr:`RowStore.reserved_at_peak`, the entries the rows then reserved (kept
and to come)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any, cast

import torch

from kvbench.engine.cache import EvictionCache
from kvbench.engine.scoring import uses_normaliser
from kvbench.engine.shelf import Shelf, Stored, host_int, modifier_capacity, running_sums, shelf_key
from kvbench.policies.base import Modifier
from kvbench.policies.stats import memoised


def storable(cache: EvictionCache) -> bool:
    """Whether a row's decode steps only append its token and attend (see the module's docstring), or do until its
    next eviction (:func:`stored_between_evictions`)."""
    plain = not any(cache.windows) and not cache.learned_sinks and cache.quant is None
    plain = plain and cache.scorer.pruner is None  # ThinK's keys are held in part of their channels
    stores = all(modifier.stores() for modifier in cache.attending) and not cache.policy.reads
    between = not cache.decode_evict or stored_between_evictions(cache)
    return cache.attn_backend == "sdpa" and plain and stores and between


def stored_between_evictions(cache: EvictionCache) -> bool:
    """Whether a row that evicts while decoding is stored between its evictions: its steps in between only append and
    attend, but for the queries its next eviction reads, which the store keeps (:meth:`RowStore.saw`) — a ranking
    from the keys, or from a window of queries, each layer's length the same for every head — or a running score
    whose sums read each query's normaliser (H2O's, causal: :func:`~kvbench.engine.scoring.uses_normaliser`), which
    its shelf adds for every row by one pass a step (:meth:`Shelf.add_sums`). Not a non-causal running score, an
    attending modifier, a cascading layer budget or a head-wise share: those rows are attended alone."""
    policy = cache.policy
    running = not policy.running or uses_normaliser(policy)
    plain = running and policy.statistic != "reconstruction" and not policy.shares_heads
    return plain and not cache.attending and cache.allocation is None


#: a shelf stepped: its units (row place × Hc + head) and slots on its device, the slots on the host
Stepping = tuple[Shelf, torch.Tensor, torch.Tensor, torch.Tensor]


class RowStore:
    """The stored rows of a decode (:func:`~kvbench.engine.rows.finished_rows`), on shelves by layer, head layout and
    capacity."""

    def __init__(self, restore: bool = False) -> None:
        #: whether a finished row's entries move back into its cache (:meth:`release`; a test reads them there)
        self.restore = restore
        self.shelves: dict[tuple, Shelf] = {}
        self.places: dict[int, Stored] = {}  # id(cache) → the row stored
        self.stepping: list[list[Shelf]] = []  # by layer, this step's shelves
        #: the step's rows (by id; -1 where attended alone) and by layer each shelf with its units and slots (on the
        #: device, and on the host): made again when the rows or their slots change
        self.layout: tuple[tuple[int, ...], list[list[Stepping]]] | None = None
        self.reserved = 0  # the bytes the rows reserve (Stored.reserved) now
        self.peak_bytes = self.reserved_at_peak = 0
        #: the last steps' queries for the stored rows' next evictions (:meth:`saw`): each step's rows (by id, -1
        #: where attended alone) and by layer its queries ``[N,Hq,1,D]``; as many steps as the longest window
        self.recent: deque[tuple[tuple[int, ...], list[torch.Tensor | None]]] = deque()
        self.window = 0

    def begin_step(
        self, caches: list[EvictionCache], positions: list[int], to_come: list[int], evicts: list[bool]
    ) -> list[int]:
        """Store the step's storable rows not stored yet (``to_come``: the tokens each may append stored) and declare
        the step; a stored row that evicts in it (``evicts``) leaves the store first. Returns the batch places of the
        rows attended each alone."""
        arriving: dict[tuple, list[tuple[Stored, list[int]]]] = {}
        for place, (cache, position, more) in enumerate(zip(caches, positions, to_come)):
            if evicts[place]:  # it evicts alone, its entries and queries back in its cache
                self.release(cache)
                continue
            if id(cache) in self.places or not storable(cache):
                continue
            kept = [layer.held_per_head() for layer in cache.eviction_layers]
            keys = cache.eviction_layers[0].keys  # [1,Hc,T,D]
            entry = 2 * keys.shape[-1] * keys.element_size()  # a token's key and value in one cache head
            reserved = sum(length + more for lengths in kept for length in lengths) * entry
            appended = [layer.get_seq_length() for layer in cache.eviction_layers]
            row = Stored(cache, position, kept, appended, more, reserved, [[None] * len(lengths) for lengths in kept])
            if cache.decode_evict:  # what its next eviction reads, and its bytes as they grow (held_bytes)
                row.windows = [cache.scorer.query_window(budget) for budget in cache.layer_budgets]
                row.bytes_when_stored, row.token_bytes = sum(cache.live_bytes), entry * len(kept[0]) * len(kept)
            for layer, lengths in enumerate(kept):
                shelved: dict[tuple, list[int]] = {}
                for head, length in enumerate(lengths):
                    capacity = modifier_capacity(cache, length + more)
                    shelved.setdefault(shelf_key(cache, layer, capacity), []).append(head)
                for key, heads in shelved.items():
                    if key not in self.shelves:
                        self.shelves[key] = Shelf(cache, layer, key[-1])
                    arriving.setdefault(key, []).append((row, heads))
            self.places[id(cache)] = row
            self.reserved += row.reserved
        for key, units in arriving.items():
            self.shelves[key].place(units)
        for row in {id(row): row for units in arriving.values() for row, _ in units}.values():
            hollow: dict[Hashable, Any] = {}  # no entries, one tensor of a shape (nothing writes into it)
            for index, entries in enumerate(row.cache.eviction_layers):  # held on the shelves now
                keys = entries.keys
                shape = (*keys.shape[:2], 0, keys.shape[3])
                entries.keys = entries.values = hollow_like(hollow, shape, keys)
                if running_sums(row.cache) is not None:  # its scores on the shelves too
                    assert entries.running_score is not None  # placed (Shelf.place)
                    entries.running_score = entries.running_score[:, :, :0].clone()
                if (own := entries.headwise) is not None:
                    own.keys = own.values = hollow_like(hollow, (0, keys.shape[3]), keys)
                    entries.layout = None
                for modifier in row.cache.attending:  # its state too, made again when the row leaves
                    if (index, modifier.name) in row.unit_sizes:
                        del entries.modifier_state[modifier.name]
        if any([shelf.compact() for shelf in self.shelves.values()]):
            self.layout = None
        members = tuple(id(cache) if id(cache) in self.places else -1 for cache in caches)
        if self.layout is None or self.layout[0] != members:
            self.layout = members, self._layout(caches, len(caches[0].layers))
            self.window = max((max(row.windows, default=0) for row in self.places.values()), default=0)
        if self.window:
            self.recent.append((members, [None] * len(caches[0].layers)))
        while len(self.recent) > self.window:
            self.recent.popleft()
        self.stepping = []
        for by_shelf in self.layout[1]:
            for shelf, *step in by_shelf:
                shelf.begin_step(*step)
            self.stepping.append([shelf for shelf, *_ in by_shelf])
        if (held := sum(shelf.bytes() for shelf in self.shelves.values())) > self.peak_bytes:
            self.peak_bytes, self.reserved_at_peak = held, self.reserved
        return [place for place, cache in enumerate(caches) if id(cache) not in self.places]

    def _layout(self, caches: list[EvictionCache], layers: int) -> list[list[Stepping]]:
        """By layer, each shelf with the units (row place × Hc + head) and slots of its rows in this step."""
        by_layer: list[dict[int, tuple[Shelf, list[int], list[int]]]] = [{} for _ in range(layers)]
        for place, cache in enumerate(caches):
            if (row := self.places.get(id(cache))) is not None:
                for layer, by_head in enumerate(row.slots):
                    for head, found in enumerate(by_head):
                        assert found is not None  # every unit of a stored row is on a shelf
                        shelf, slot = found
                        _, units, slots = by_layer[layer].setdefault(id(shelf), (shelf, [], []))
                        units.append(place * shelf.heads + head)
                        slots.append(slot)
        listed = [(shelf, units, slots) for shelves in by_layer for shelf, units, slots in shelves.values()]
        if not listed:
            return [[] for _ in by_layer]
        # every shelf's units and slots copied to the device at once (each copy from the host synchronises a GPU)
        on_host = torch.tensor([index for _, units, slots in listed for index in (*units, *slots)])
        sizes = [2 * len(units) for _, units, _ in listed]  # each shelf's units, then its slots
        on_device = on_host.to(listed[0][0].keys.device).split(sizes)
        by_shelf = iter(
            (shelf, *both.chunk(2), host.chunk(2)[1])
            for (shelf, _, _), both, host in zip(listed, on_device, on_host.split(sizes))
        )
        return [[next(by_shelf) for _ in shelves] for shelves in by_layer]

    def saw(self, layer: int, query: torch.Tensor) -> None:
        """The step's queries ``[N,Hq,1,D]`` at ``layer``, kept (not copied) where a stored row's next eviction reads
        a window of them: moved into its cache when it leaves (:meth:`release`)."""
        if self.window:
            self.recent[-1][1][layer] = query

    def seen_by(self, cache: EvictionCache, layer: int, steps: int) -> torch.Tensor:
        """A stored row's queries ``[1,Hq,steps,D]`` at ``layer`` in its last ``steps`` (it stepped in each: a row
        leaves before a step)."""
        queries = []
        for members, by_layer in list(self.recent)[-steps:]:
            query = by_layer[layer]
            assert query is not None  # every layer of a step with stored rows saw its queries
            queries.append(query[members.index(id(cache)), :, 0])  # [Hq,D]
        return torch.stack(queries, dim=1)[None]

    def held_bytes(self, cache: EvictionCache, position: int) -> int:
        """The bytes a row's cache holds after its token at ``position`` (stored: as its own entries would)."""
        row = self.places.get(id(cache))
        if row is None:
            return sum(cache.live_bytes)
        return row.bytes_when_stored + (position - row.first_position + 1) * row.token_bytes

    def release(self, cache: EvictionCache) -> None:
        """Move a leaving row's entries back into its cache, the tokens it decoded appended (nothing where it was not
        stored); a shelf left empty is let go (a long sweep's rows come and go: its shelves are those in flight). A
        finished row leaves by :meth:`leave`."""
        row = self.places.pop(id(cache), None)
        if row is None:
            return
        self.layout = None
        self.reserved -= row.reserved
        for index, (layer, kept, by_head) in enumerate(zip(cache.eviction_layers, row.kept, row.slots)):
            found_slots = [found for found in by_head if found is not None]
            assert len(found_slots) == len(by_head)  # every unit of a stored row is on a shelf
            self.restore_states(row, index, found_slots)
            entries, scores = [], []
            for shelf, slot in found_slots:
                if shelf.scores is not None:
                    scores.append(shelf.unit_scores(slot))
                entries.append(shelf.take(slot))
                if shelf.count == 0:
                    self.shelves.pop(shelf.key, None)
            decoded, appended = entries[0][0].shape[0] - kept[0], row.appended[index]  # the same for every head
            start = [length - appended for length in kept]  # each head's own entries, before those appended
            if layer.headwise is not None:  # packed back, head after head
                layer.headwise.keys = torch.cat([keys[:first] for (keys, _), first in zip(entries, start)])
                layer.headwise.values = torch.cat([values[:first] for (_, values), first in zip(entries, start)])
            keys = torch.stack([keys[first:] for (keys, _), first in zip(entries, start)])[None]  # [1,Hc,a+d,D]
            values = torch.stack([values[first:] for (_, values), first in zip(entries, start)])[None]
            # the stacked copy itself, the decoded tokens after it: appending them writes in place (layer.appended)
            layer.keys, layer.values = keys[:, :, :appended], values[:, :, :appended]
            if decoded > 0:
                first = row.first_position  # its positions made on the device (a copy from the host synchronises)
                positions = torch.arange(first, first + decoded, device=keys.device)
                layer.append(keys[:, :, appended:], values[:, :, appended:], positions)
                cache.account(index)
                if row.windows and (window := min(row.windows[index], decoded)):
                    seen = self.seen_by(cache, index, window)
                    layer.remember_queries(seen, positions[-window:], row.windows[index])
            if scores:  # [1,Hc,a+d], as its own appends and sums would have made them
                layer.running_score = torch.stack(scores)[None]
        cache.seen += decoded

    def leave(self, caches: list[EvictionCache]) -> None:
        """The finished rows of ``caches`` leave the store (:meth:`release`, or together :meth:`let_go`)."""
        if self.restore:
            for cache in caches:
                self.release(cache)
        else:
            self.let_go(caches)

    def let_go(self, caches: list[EvictionCache]) -> None:
        """Finished rows leave: their units freed together, a shelf's by one write, and their entries not moved back
        (nothing reads them: the run lets the caches go); what their outputs read is as their own caches would hold
        it, the tokens they decoded appended — each layer's peak tokens per head and bytes held — and the state of
        their attending modifiers whose statistics read it (``reports_state``: views of the shelves, to be read
        before a step places rows in their regions)."""
        freed: dict[int, tuple[Shelf, list[int]]] = {}
        for cache in caches:
            row = self.places.pop(id(cache), None)
            if row is None:
                continue
            self.layout = None
            self.reserved -= row.reserved
            shelf, slot = cast(tuple[Shelf, int], row.slots[0][0])
            decoded = host_int(shelf.lengths[slot]) - row.kept[0][0]  # the same for every unit
            reported = [held for held in cache.attending if held.reports_state]
            for index, (layer, kept, by_head) in enumerate(zip(cache.eviction_layers, row.kept, row.slots)):
                found_slots = [cast(tuple[Shelf, int], found) for found in by_head]
                self.restore_states(row, index, found_slots, reported, copy=False)
                for shelf, slot in found_slots:
                    freed.setdefault(id(shelf), (shelf, []))[1].append(slot)
                layer.peak_tokens = max(layer.peak_tokens, sum(kept) // len(kept) + decoded)  # its tokens per head
                entry = 2 * layer.keys.shape[-1] * layer.keys.element_size()  # a token's key and value, a cache head
                cache.hold(index, cache.live_bytes[index] + decoded * entry * len(kept))
            cache.seen += decoded
        for shelf, slots in freed.values():
            shelf.free(slots)
            if shelf.count == 0:
                self.shelves.pop(shelf.key, None)

    def restore_states(
        self,
        row: Stored,
        index: int,
        found_slots: list[tuple[Shelf, int]],
        modifiers: list[Modifier] | None = None,
        copy: bool = True,
    ) -> None:
        """Layer ``index``'s attending modifiers' state (``modifiers``: those of them; None: all) of a leaving ``row``,
        back in its cache as one ``[1,Hc,...]`` state from its units' ``found_slots`` (``copy=False``: views of the
        shelf where its units follow one another)."""
        layer = row.cache.eviction_layers[index]
        runs: list[tuple[Shelf, list[int]]] = []  # the units in head order, those on one shelf together
        for shelf, slot in found_slots:
            if runs and runs[-1][0] is shelf:
                runs[-1][1].append(slot)
            else:
                runs.append((shelf, [slot]))
        for modifier in row.cache.attending if modifiers is None else modifiers:
            if (sizes := row.unit_sizes.get((index, modifier.name))) is not None:
                parts = [shelf.units_state(modifier.name, slots, sizes, copy) for shelf, slots in runs]
                stacked = {
                    name: (torch.cat([part[name] for part in parts]) if len(parts) > 1 else parts[0][name])[None]
                    for name in sizes
                }
                layer.modifier_state[modifier.name] = modifier.of_units(stacked)


def hollow_like(made: dict[Hashable, Any], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``shape`` and ``like``'s dtype, one per shape and dtype in ``made`` (nothing writes to it)."""
    return memoised(made, (shape, like.dtype), lambda: like.new_empty(shape))
