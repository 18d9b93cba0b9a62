"""A layer's shelf of stored decode units (:mod:`kvbench.engine.store`): one flat buffer ``[P,D]`` where each (row,
cache head) unit holds a region of its capacity (its kept entries and the tokens it may append,
:func:`capacity_class`: under an eighth to spare), appended by one scatter and attended by one call a step — the
region kernel on CUDA (:mod:`kvbench.kernels.decode`), one SDPA call over the regions gathered to the longest
elsewhere; where attending modifiers hold state (SLAKE, CaliDrop), a shelf of one capacity attends every unit by one
SDPA call over its buffer viewed ``[U,C,D]``, the modifiers' outputs replacing SDPA's where their state holds
something."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from kvbench import kernels
from kvbench.engine.cache import EvictionCache
from kvbench.engine.layer import in_cache_heads
from kvbench.engine.scoring import sums_key
from kvbench.kernels import decode
from kvbench.policies.parts import settings_key

#: how a shelf without attending modifiers attends its units: ``auto`` (the region kernel on CUDA where triton is
#: installed, one padded SDPA call elsewhere), ``kernel`` (also under Triton's interpreter: the tests) or ``padded``
REGION_ATTENTION = "auto"
#: how shelves where modifiers attend hold their units: ``auto`` (every capacity on one shelf on CUDA, whose launches
#: bound a step, its regions gathered to the longest each step; a shelf per capacity elsewhere, viewed without a
#: copy), ``mixed`` or ``by_capacity``
MODIFIER_SHELVES = "auto"


def modifier_capacity(cache: EvictionCache, needed: int) -> int | None:
    """The capacity that keys a shelf of ``cache``'s units needing ``needed`` slots where modifiers attend on a shelf
    of one capacity (:data:`MODIFIER_SHELVES`); None where a shelf holds every capacity."""
    on_cuda = cache.eviction_layers[0].keys.is_cuda
    mixed = MODIFIER_SHELVES == "mixed" or MODIFIER_SHELVES == "auto" and on_cuda
    return None if not cache.attending or mixed else capacity_class(needed)


def capacity_class(needed: int) -> int:
    """The slots a unit needing ``needed`` is given: ``needed`` rounded up to an eighth of its octave (``< 12.5 %``
    spare; exact up to 16), so that a freed region fits the next unit of its class."""
    step = 1 << max(0, (needed - 1).bit_length() - 4)
    return -(-needed // step) * step


def grown(tensor: torch.Tensor, missing: int) -> torch.Tensor:
    """``tensor [S,...]`` with ``missing`` zero slots after its own."""
    return torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])


def padding(held: torch.Size, arriving: torch.Size) -> list[int] | None:
    """``F.pad``'s widths growing a shelf's state of units ``held`` to hold one of ``arriving`` (None: it does)."""
    if all(size >= more for size, more in zip(held, arriving)):
        return None
    return [width for size, more in reversed(list(zip(held, arriving))) for width in (0, max(0, more - size))]


def within(first: int | slice | torch.Tensor, sizes: torch.Size) -> tuple[Any, ...]:
    """The index of a padded state's units ``first`` cut to a unit's ``sizes``."""
    return (first, *(slice(0, size) for size in sizes))


def following(slots: list[int]) -> slice | None:
    """``slots`` as a slice where they follow one another (a row's units placed together), else None: an index
    that is not copied to the device (a copy from the host synchronises a GPU)."""
    return slice(slots[0], slots[-1] + 1) if slots == list(range(slots[0], slots[0] + len(slots))) else None


@dataclass(eq=False)
class Stored:
    """A stored row: its cache, the position of its first stored token, each layer's entries per head when stored and
    each unit's shelf and unit there."""

    cache: EvictionCache
    first_position: int
    kept: list[list[int]]  # [layer][head]
    appended: list[int]  # by layer, the entries appended to it before (after a head-wise eviction, beside its own)
    to_come: int  # the tokens it may still append
    reserved: int  # the bytes of the entries it may hold, every unit's (kept and to come)
    slots: list[list[tuple[Shelf, int] | None]] = field(default_factory=list)  # [layer][head]
    #: by (layer, attending modifier), the sizes of each unit's state tensors (``Modifier.units``), held on the shelves
    unit_sizes: dict[tuple[int, str], dict[str, torch.Size]] = field(default_factory=dict)
    #: by layer, the queries its next eviction reads (a row that evicts while decoding: ``Scorer.query_window``)
    windows: list[int] = field(default_factory=list)
    bytes_when_stored: int = 0  # the cache's bytes when stored (``EvictionCache.live_bytes``)
    token_bytes: int = 0  # the bytes each token it appends adds, every layer's


def running_sums(cache: EvictionCache) -> str | None:
    """The running sums a row's units add on a shelf at each step (:func:`~kvbench.engine.scoring.sums_key`) where it
    evicts while decoding by a running score (H2O's); None where its steps only append and attend."""
    return sums_key(cache.policy) if cache.decode_evict and cache.policy.running else None


def shelf_key(cache: EvictionCache, layer: int, capacity: int | None = None) -> tuple:
    """The shelf of a row's units at ``layer``: one head layout, attending modifiers and running sums (and one
    ``capacity`` where modifiers attend: :class:`Shelf`)."""
    return layer, cache.cache_heads, cache.repeat_layout, settings_key(*cache.attending), running_sums(cache), capacity


def host_int(value: torch.Tensor) -> int:
    """A host tensor's one value (a shelf's own bookkeeping, never on a device), read by ``tolist``: ``int()`` would
    dispatch ``item``, which the operator counts take for a device's value read back."""
    return cast(int, value.tolist())


def spans(starts: torch.Tensor, lengths: torch.Tensor | list[int], device) -> torch.Tensor:
    """The flat indices of regions at ``starts [n]`` of ``lengths`` entries each, region after region."""
    counts = torch.as_tensor(lengths, dtype=torch.long)
    total = host_int(counts.sum())  # the output's size given: nothing read back from where the counts are
    offsets = torch.arange(total) - torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)
    return (torch.repeat_interleave(starts, counts, output_size=total) + offsets).to(device)


class Shelf:
    """One layer's units of one head layout and attending modifiers in one flat buffer ``keys``/``values [P,D]``: unit
    ``u`` holds ``lengths[u]`` entries (its kept ones, then the tokens appended since) at ``starts[u]`` of a region of
    ``capacities[u]`` slots. A unit that leaves keeps its region free for the next one of its capacity. ``starts`` and
    ``lengths`` on the host, and on the device (copied there once after units arrive or move: a step then copies nothing
    to the device, which on CUDA waits for the queue, and reads nothing back). ``heads``: the cache heads of its rows,
    ``query_heads`` their queries'. ``modifiers``: its rows' attending ones, each with its units' state (``states``:
    ``Modifier.units``' tensors ``[U,...]``, made with the first unit that holds one) and ``active [U]``, the units
    whose state holds something. ``scores [P]`` (float32, where its rows add running sums: :func:`running_sums`) is each
    entry's running score, the step's sums of every unit added by one pass (:meth:`add_sums`)."""

    def __init__(self, like: EvictionCache, layer: int, uniform: int | None = None) -> None:
        first = like.eviction_layers[layer].keys
        self.key = shelf_key(like, layer, uniform)
        #: where attending modifiers hold state, every unit's capacity: its regions one after another, the buffer
        #: viewed ``[U,C,D]`` (their attention pads no copy; the modifiers' states are padded to it too)
        self.uniform = uniform
        self.layer, self.dim = layer, first.shape[-1]
        self.heads, self.query_heads, self.repeat_layout = like.cache_heads, like.num_query_heads, like.repeat_layout
        self.keys, self.values = first.new_zeros(0, self.dim), first.new_zeros(0, self.dim)
        self.modifiers = like.attending
        self.scorer = like.scorer  # the running sums' pass, the same for every row of the shelf (its key)
        self.scores = None if running_sums(like) is None else first.new_zeros(0, dtype=torch.float32)
        self.states: list[dict[str, torch.Tensor] | None] = [None] * len(self.modifiers)
        self.active = [torch.zeros(0, dtype=torch.bool, device=first.device) for _ in self.modifiers]
        self.owners: list[tuple[Stored, int] | None] = []
        self.count = 0  # the units owned
        self.starts, self.counted = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        #: the steps not yet counted in ``lengths`` on the host, each one more entry of the units ``stepped``
        self.uncounted, self.stepped = 0, torch.empty(0, dtype=torch.long)
        self.capacities: list[int] = []
        #: ``starts`` and ``lengths`` on the keys' device, None once units arrive or move (not when one is freed)
        self.on_device: tuple[torch.Tensor, torch.Tensor] | None = None
        #: this step's: the stored units (row place × Hc + head) [n], their units [n], each one's region start [n],
        #: ``ends [2,n]`` where each writes and its entries after the step, the longest unit; ``host_ones`` [n] ones
        self.members = self.slots = self.step_starts = self.ends = torch.empty(0)
        self.host_ones = torch.empty(0, dtype=torch.long)
        self.longest = 0
        self.shrunk = False  # units freed since the last step (:meth:`free`)
        self.whole = False  # this step's units are every unit, in order (``slots`` = 0 .. U−1)

    @property
    def lengths(self) -> torch.Tensor:
        """Each unit's entries ``[U]`` on the host, the steps not counted since it was last read added by one write."""
        if self.uncounted:
            self.counted.index_add_(0, self.stepped, self.host_ones, alpha=self.uncounted)
            self.uncounted = 0
        return self.counted

    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def free_entries(self) -> int:
        """The slots of the regions no unit owns."""
        return sum(size for size, owner in zip(self.capacities, self.owners) if owner is None)

    def place(self, units: list[tuple[Stored, list[int]]]) -> None:
        """Move the layer's kept entries of each row's ``heads`` into free regions of their capacity (the entries kept
        and to come, :func:`capacity_class`), the buffer grown once by the regions missing."""
        wanted = [[capacity_class(row.kept[self.layer][head] + row.to_come) for head in heads] for row, heads in units]
        free: dict[int, list[int]] = {}
        for unit, owner in enumerate(self.owners):
            if owner is None:
                free.setdefault(self.capacities[unit], []).append(unit)
        chosen, missing = [], []
        for capacities in wanted:
            chosen.append([free[size].pop(0) if free.get(size) else -1 for size in capacities])
            missing += [size for size, unit in zip(capacities, chosen[-1]) if unit < 0]
        if missing:
            first_unit, end = len(self.owners), self.keys.shape[0]
            grown_by = sum(missing)
            self.keys, self.values = grown(self.keys, grown_by), grown(self.values, grown_by)
            if self.scores is not None:
                self.scores = grown(self.scores, grown_by)
            sizes = torch.tensor(missing)
            self.starts = torch.cat([self.starts, end + sizes.cumsum(0) - sizes])
            self.capacities += missing
            self.counted = grown(self.lengths, len(missing))
            self.owners += [None] * len(missing)
            self.states = [
                None if state is None else {name: grown(tensor, len(missing)) for name, tensor in state.items()}
                for state in self.states
            ]
            self.active = [grown(active, len(missing)) for active in self.active]
            new_units = iter(range(first_unit, first_unit + len(missing)))
            chosen = [[next(new_units) if unit < 0 else unit for unit in picked] for picked in chosen]
        self.on_device = None
        self.place_entries(units, chosen)
        for (row, heads), picked in zip(units, chosen):
            for head, unit in zip(heads, picked):
                self.owners[unit] = (row, head)
                row.slots[self.layer][head] = (self, unit)
            self.count += len(heads)
        self.place_states([(row, heads, picked) for (row, heads), picked in zip(units, chosen)])

    def place_entries(self, units: list[tuple[Stored, list[int]]], chosen: list[list[int]]) -> None:
        """The entries of the arriving rows' heads into their units ``chosen``, every unit's length too: every row's
        by one index (one copy of it to the device) and one write of each tensor (a head-wise layer's heads each
        from its own entries, then those appended)."""
        placed: list[int] = []
        lengths, keys, values, scores = [], [], [], []
        for (row, heads), picked in zip(units, chosen):
            layer = row.cache.eviction_layers[self.layer]
            placed += picked
            lengths += [row.kept[self.layer][head] for head in heads]
            if layer.headwise is not None:  # (its running score went with its head-wise eviction)
                assert self.scores is None, "a head-wise layer adds no running sums (stored_between_evictions)"
                own = [length - row.appended[self.layer] for length in row.kept[self.layer]]
                for head in heads:
                    start = sum(own[:head])
                    keys += [layer.headwise.keys[start : start + own[head]], layer.keys[0, head]]
                    values += [layer.headwise.values[start : start + own[head]], layer.values[0, head]]
                continue
            every = heads == list(range(layer.keys.shape[1]))
            pick: slice | list[int] = slice(None) if every else heads  # a list index would be copied to the device
            keys.append(layer.keys[0, pick].flatten(0, 1))  # [h·T,D]
            values.append(layer.values[0, pick].flatten(0, 1))
            if self.scores is not None:
                assert layer.running_score is not None  # a running row's evicting prefill scored every layer
                scores.append(layer.running_score[0, pick].flatten())
        index = spans(self.starts[placed], lengths, self.keys.device)
        self.keys[index], self.values[index] = torch.cat(keys), torch.cat(values)
        if self.scores is not None:
            self.scores[index] = torch.cat(scores)
        self.lengths[placed] = torch.tensor(lengths)

    def place_states(self, arrivals: list[tuple[Stored, list[int], list[int]]]) -> None:
        """The attending modifiers' state of each arriving row's heads at this layer into its units (``(row, heads,
        units)``), each tensor's size of a unit kept in ``row.unit_sizes``: the units of one size by one write of each
        tensor."""
        for place, modifier in enumerate(self.modifiers):
            by_size: dict[tuple[tuple[str, torch.Size], ...], tuple[list[int], list[dict[str, torch.Tensor]]]] = {}
            for row, heads, slots in arrivals:
                layer = row.cache.eviction_layers[self.layer]
                if (units := modifier.units(layer.state_of(modifier))) is None:
                    continue
                sizes = {name: unit.shape[2:] for name, unit in units.items()}
                row.unit_sizes[self.layer, modifier.name] = sizes
                own = following(heads) or heads  # its heads by a slice: a view, not a copy
                held_slots, held = by_size.setdefault(tuple(sizes.items()), ([], []))
                held_slots += slots
                held.append({name: tensor[0, own] for name, tensor in units.items()})
            if not by_size:
                continue
            if (state := self.states[place]) is None:
                shelf, first = len(self.owners), next(iter(by_size.values()))[1][0]
                state = {name: tensor.new_zeros(shelf, *tensor.shape[1:]) for name, tensor in first.items()}
                self.states[place] = state
            for name, tensor in state.items():  # grown once to the longest unit (CaliDrop's evicted entries)
                longest = zip(tensor.shape[1:], *(dict(shape)[name] for shape in by_size))
                if (pad := padding(tensor.shape[1:], torch.Size(max(sizes) for sizes in longest))) is not None:
                    state[name] = F.pad(tensor, pad)
            for shape, (slots, held) in by_size.items():
                index = self.unit_index(slots)
                for name, size in shape:
                    parts = [units[name] for units in held]
                    state[name][within(index, size)] = parts[0] if len(parts) == 1 else torch.cat(parts)
            self.active[place][self.unit_index([slot for slots, _ in by_size.values() for slot in slots])] = True

    def take(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Free unit ``slot`` (its region kept for the next unit of its capacity); its entries ``[length,D]`` (views of
        the shelf: copy what is kept; its attending state: :meth:`units_state`)."""
        start, length = host_int(self.starts[slot]), host_int(self.lengths[slot])
        self.free([slot])
        return self.keys[start : start + length], self.values[start : start + length]

    def free(self, slots: list[int]) -> None:
        """Free units ``slots`` (their regions kept for the next units of their capacities), entries not read."""
        for slot in slots:
            self.owners[slot] = None
        self.lengths[slots] = 0
        if self.modifiers:
            index = self.unit_index(slots)
            for active in self.active:
                active[index] = False
        self.count -= len(slots)
        self.shrunk = True  # the longest taken again at the next step; the other units' starts and lengths stand

    def unit_index(self, slots: list[int]) -> slice | torch.Tensor:
        """Units ``slots`` as an index of the shelf's tensors: a slice where they follow one another (nothing copied
        to the device: a copy from the host synchronises a GPU), else the slots on the device."""
        return following(slots) or torch.tensor(slots, device=self.keys.device)

    def unit_scores(self, slot: int) -> torch.Tensor:
        """The running scores ``[length]`` of unit ``slot``'s entries (a view: read before :meth:`take`)."""
        assert self.scores is not None  # a shelf of running rows
        start, length = host_int(self.starts[slot]), host_int(self.lengths[slot])
        return self.scores[start : start + length]

    def units_state(
        self, modifier: str, slots: list[int], sizes: dict[str, torch.Size], copy: bool = True
    ) -> dict[str, torch.Tensor]:
        """The state of ``modifier`` (a name) that units ``slots`` hold, each tensor ``[n,...]`` cut to their units'
        ``sizes``: a copy, by one slice where the slots follow one another (a row's units placed together; with
        ``copy=False`` that slice itself, a view)."""
        place = [held.name for held in self.modifiers].index(modifier)
        state = self.states[place]
        assert state is not None  # a unit with sizes placed its state
        if (run := following(slots)) is not None:
            views = {name: state[name][within(run, size)] for name, size in sizes.items()}
            return {name: view.clone() for name, view in views.items()} if copy else views
        return {name: torch.stack([state[name][within(slot, size)] for slot in slots]) for name, size in sizes.items()}

    def compact(self) -> bool:
        """Copy the shelf without its free regions where they are more than a sixteenth of it; whether it did."""
        if self.free_entries() <= self.keys.shape[0] // 16:
            return False
        held = [unit for unit, owner in enumerate(self.owners) if owner is not None]
        kept = torch.tensor(held, dtype=torch.long)
        capacities = [self.capacities[unit] for unit in held]
        index = spans(self.starts[kept], capacities, self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        if self.scores is not None:
            self.scores = self.scores.index_select(0, index)
        sizes = torch.tensor(capacities, dtype=torch.long)
        self.starts, self.capacities = sizes.cumsum(0) - sizes, capacities
        self.counted, self.owners = self.lengths[kept], [self.owners[unit] for unit in held]
        self.on_device = None
        on_device = kept.to(self.keys.device)
        self.active = [active[on_device] for active in self.active]
        self.states = [
            None if state is None else {name: tensor[on_device] for name, tensor in state.items()}
            for state in self.states
        ]
        for unit, owner in enumerate(self.owners):
            assert owner is not None  # a held unit
            row, head = owner
            row.slots[self.layer][head] = (self, unit)
        return True

    def begin_step(self, members: torch.Tensor, slots: torch.Tensor, on_host: torch.Tensor) -> None:
        """This step's units: ``members [n]`` (row place × Hc + head) in units ``slots [n]`` (``on_host``: the same on
        the host), one token each. Where they are the last step's (the same layout, no unit placed or taken since),
        where each writes and how long it is are the last step's one further: one addition, not a gather."""
        device = self.keys.device
        again = self.on_device is not None and slots is self.slots
        if self.on_device is None:  # the units changed
            self.on_device = self.starts.to(device, copy=True), self.lengths.to(device, copy=True)  # own, on a CPU too
            self.shrunk = True
        if self.shrunk:  # (units freed alone leave the others' starts and lengths on the device as they are)
            self.longest, self.shrunk = host_int(self.lengths.max()), False
        starts, lengths = self.on_device
        if again:
            self.ends = self.ends + 1  # [2,n]
        else:
            self.counted = self.lengths  # the steps so far counted before the units stepping change
            self.members, self.slots, self.host_ones = members, slots, torch.ones_like(on_host)
            self.stepped, self.whole = on_host, on_host.tolist() == list(range(len(self.owners)))
            self.step_starts, held = starts[slots], lengths[slots]
            self.ends = torch.stack([self.step_starts + held, held + 1])
        lengths.index_put_((slots,), self.ends[1])  # each unit's entries after the step (a unit steps once)
        self.uncounted += 1  # on the host, counted when read (:attr:`lengths`)
        self.longest += 1  # every unit held steps (a finished row leaves before the step)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the step's keys/values of the stored units (``[N,Hkv,1,D]`` of the batch) after each unit's entries:
        one scatter each."""
        keys, values = in_cache_heads(key_states, value_states, self.query_heads, self.repeat_layout)  # [N,Hc,1,D]
        self.keys.index_put_((self.ends[0],), keys.flatten(0, 1)[self.members, 0])
        self.values.index_put_((self.ends[0],), values.flatten(0, 1)[self.members, 0])
        if self.scores is not None:  # a new entry's score starts from 0 (the region may hold a former unit's)
            self.scores.index_fill_(0, self.ends[0], 0.0)

    def attend(self, query: torch.Tensor, scaling: float, joined: torch.Tensor) -> None:
        """Write the stored units' attention outputs into the batch's ``joined [N,1,Hq,D]`` for its single queries
        ``query [N,Hq,1,D]``: each unit's query heads (``G = Hq / Hc``) over its region, in one call — the region
        kernel on CUDA (:mod:`kvbench.kernels.decode`), one padded SDPA call elsewhere; with attending modifiers every
        unit padded to the longest, and the modifiers' outputs where their state holds something."""
        group = self.query_heads // self.heads
        units = query.reshape(-1, group, query.shape[-1])[self.members]  # [n,G,D]: (row, head) → its query heads
        if self.modifiers:
            output = self.attend_modified(units, scaling)
        elif kernels.available() and (REGION_ATTENTION == "kernel" or REGION_ATTENTION == "auto" and query.is_cuda):
            output = decode.region_attention(units, self.keys, self.values, self.step_starts, self.ends[1], scaling)
        else:
            output = decode.padded_region_attention(
                units, self.keys, self.values, self.step_starts, self.ends[1], scaling, self.longest
            )
        if self.scores is not None:
            self.add_sums(units, output, scaling)
        joined.view(-1, group, query.shape[-1]).index_copy_(0, self.members, output)

    def add_sums(self, units: torch.Tensor, output: torch.Tensor, scaling: float) -> None:
        """Add the step's running sums of every unit (queries ``units [n,G,D]``, outputs ``output [n,G,D]``) to its
        entries' scores: the policy's pass (:meth:`~kvbench.engine.scoring.Scorer.normalised_sums`) over the regions
        gathered to the longest, as a batch of ``n`` rows of one cache head, each query's normaliser over its own
        region; the padding's sums are dropped."""
        assert self.scores is not None
        span = decode.counting(self.longest, units.device)
        visible = span < self.ends[1][:, None]  # [n,T]
        keys, values = decode.padded_regions(self.keys, self.values, self.step_starts, self.longest)  # [n,T,D]
        logits = torch.matmul(units.float(), keys.float().transpose(1, 2)).mul_(scaling)  # [n,G,T]
        lse = logits.masked_fill_(~visible[:, None], float("-inf")).logsumexp(dim=-1)  # [n,G]
        sums = self.scorer.normalised_sums(
            units[:, :, None], keys[:, None], values[:, None], output[:, None], scaling, lse[..., None]
        )  # [n,1,T]
        index = (self.step_starts[:, None] + span).clamp_(max=self.scores.shape[0] - 1)  # the padding's: 0 added
        self.scores.index_add_(0, index.flatten(), torch.where(visible, sums[:, 0], 0.0).flatten())

    def attend_modified(self, units: torch.Tensor, scaling: float) -> torch.Tensor:
        """The step's units' outputs ``[n,G,D]`` for their queries ``units [n,G,D]`` where modifiers attend: every unit
        of the shelf (the modifiers' states are the shelf's) by one SDPA call over the regions to the longest (viewed
        on a shelf of one capacity, else gathered), SDPA's output replaced by a modifier's where its state holds
        something."""
        assert self.on_device is not None  # made by begin_step
        if self.whole:  # every unit steps, in order: the step's queries as they are
            queries = units[:, :, None]  # [U,G,1,D]
        else:  # a free unit's query zero
            queries = units.new_zeros(len(self.owners), units.shape[1], 1, units.shape[-1])
            queries.index_copy_(0, self.slots, units[:, :, None])
        holds = self.on_device[1].clamp(min=1)  # the entries each unit holds (a free one one) [U]
        visible = decode.counting(self.longest, units.device) < holds[:, None]  # [U,T]
        if self.uniform is not None:  # a shelf of one capacity: unit u's region at u·C
            keys = self.keys.view(-1, self.uniform, self.dim)[:, None, : self.longest]  # [U,1,T,D]
            values = self.values.view(-1, self.uniform, self.dim)[:, None, : self.longest]
        else:  # every capacity: each region gathered to the longest
            keys, values = (
                x[:, None] for x in decode.padded_regions(self.keys, self.values, self.on_device[0], self.longest)
            )
        output = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible[:, None, None], scale=scaling, enable_gqa=units.shape[1] > 1
        ).transpose(1, 2)  # [U,1,G,D]
        for place, (modifier, held) in enumerate(zip(self.modifiers, self.states)):
            if held is None:
                continue
            state = modifier.of_units({name: tensor[:, None] for name, tensor in held.items()})
            replaced = modifier.attend(state, queries, keys, values, output, scaling, visible)
            self.states[place] = {name: tensor[:, 0] for name, tensor in (modifier.units(state) or held).items()}
            if replaced is not None:
                output = torch.where(self.active[place][:, None, None, None], replaced, output)
        return output[:, 0] if self.whole else output[self.slots, 0]
