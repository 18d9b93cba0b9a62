"""What the variants of one shared forward compute once at a layer (:class:`~kvbench.engine.batches.SharedPrefill`),
each table by what it holds: the first variant that needs an entry computes it, the others read it. A table's key
says what its entry depends on beyond the layer's entries, which the variants share."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.engine.selection import dropped_slots, ranked_counts, top_slots, top_slots_per_head
from kvbench.policies.base import AttentionStats, Policy
from kvbench.policies.context import Evicted, slot_offsets, take_flat
from kvbench.policies.parts import settings_key


@dataclass
class SharedForward:
    """One layer's shared results in one shared forward: the entries of ``layer``, every table's key past them."""

    layer: int
    #: the window statistics of the last ``size`` queries, by size (:meth:`~kvbench.engine.scoring.Scorer.window`)
    windows: dict[int, AttentionStats] = field(default_factory=dict)
    #: the rankings ``[B,Hc,T]``, by :meth:`~kvbench.engine.scoring.Scorer.ranking_key`
    rankings: dict[tuple, torch.Tensor] = field(default_factory=dict)
    #: the entries a selection evicted, handed to the attending modifiers, by the selection's key
    evicted: dict[tuple, Any] = field(default_factory=dict)
    #: the last queries ``[B,Hq,W,D]`` and their positions ``[W]`` the variants hold, by window ``W``
    queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: what a policy computes from the entries and the layer's weights alone, by the policy's name for it
    #: (:meth:`~kvbench.policies.context.ScoreContext.once`)
    entries: dict[Hashable, Any] = field(default_factory=dict)
    #: the selections the variants wait for (:meth:`pend`), each with the variants that keep it, made at once by
    #: :meth:`select`; by the selection's key where it has one
    pending: list[Pending] = field(default_factory=list)
    pending_keys: dict[tuple, Pending] = field(default_factory=dict)
    #: the head-wise selections the variants wait for (:meth:`pend_heads`), made at once by :meth:`select_heads`
    pending_heads: list[PendingHeads] = field(default_factory=list)

    def pend(
        self,
        key: tuple | None,
        scores: torch.Tensor,
        slots: tuple[int, int, int],
        entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        keep: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], None],
        ranked: bool = False,
        drops: bool = False,
    ) -> None:
        """A variant's selection of ``slots`` (budget, recent window, sinks: :func:`top_slots`) of ``entries`` (keys,
        values ``[B,Hc,T,D]``, positions ``[B,Hc,T]``) by ``scores [B,Hc,T]``, made with the others' by
        :meth:`select`, which then calls ``keep(kept, gathered)`` (the entries and the scores at ``kept``); one
        selection for the variants of one ``key``. ``ranked``: its budget is the reserved slots and what the scores
        rank (whole chunks: :func:`~kvbench.engine.selection.ranked_budget`), counted with the others' at once.
        ``drops``: the variant hands the entries its selection drops to attending modifiers (:attr:`evicted`)."""
        pending = None if key is None else self.pending_keys.get(key)
        if pending is None:
            pending = Pending(scores, slots, entries, ranked=ranked, key=key)
            self.pending.append(pending)
            if key is not None:
                self.pending_keys[key] = pending
        pending.keeps.append(keep)
        pending.drops |= drops

    def pend_heads(
        self,
        policy: Policy,
        scores: torch.Tensor,
        slots: tuple[int, int, int],
        keep: Callable[[torch.Tensor, list[int]], None],
    ) -> None:
        """A variant's head-wise selection of ``slots`` (budget, recent window, sinks) by ``scores [1,Hc,T]``, each head
        its share (``policy.head_shares``), made with the others' by :meth:`select_heads`, which then calls ``keep(kept,
        counts)``: the slots kept ``[1,Hc,T]`` and how many each head keeps."""
        self.pending_heads.append(PendingHeads(policy, scores, slots, keep))

    def select_heads(self) -> None:
        """Every pending head-wise selection: the shares of the variants of one sharing part, slots and shape by one
        ``head_shares`` call over their rankings stacked (rows apart), every share read back at once (one host
        synchronisation a layer, not one a variant), then one top-k for those of one largest share
        (:func:`top_slots_per_head`: slice by slice the same top-k as each variant's alone)."""
        groups: dict[tuple, list[PendingHeads]] = defaultdict(list)
        for pending in self.pending_heads:
            sharer = next((part for part in pending.policy.modifiers if part.shares_heads), pending.policy)
            groups[settings_key(sharer), pending.slots, pending.scores.shape, pending.scores.dtype].append(pending)
        self.pending_heads = []
        stacked = []
        for (_, (budget, recent, sinks), *_), group in groups.items():
            tokens = group[0].scores.shape[-1]
            middle = torch.stack([pending.scores for pending in group])[..., sinks : tokens - recent].float()
            shares = group[0].policy.head_shares(middle.flatten(0, 1), budget, recent + sinks)  # [V·B,Hc]
            assert shares is not None  # the policy shares heads
            shares = shares.long().view(middle.shape[:-1]).clamp(0, middle.shape[-1])  # [V,B,Hc]
            stacked.append((group, middle, shares))
        read = iter(torch.cat([shares.flatten() for *_, shares in stacked]).tolist() if stacked else [])
        for group, middle, shares in stacked:
            recent, sinks = group[0].slots[1:]
            counts = [[next(read) for _ in range(shares[0].numel())] for _ in group]  # each variant's heads (batch 1)
            by_most: dict[int, list[int]] = defaultdict(list)
            for index, held in enumerate(counts):
                by_most[max(held)].append(index)
            for most, indices in by_most.items():
                ranked, shared = middle, shares  # the variants of this largest share:
                if len(indices) < len(group):
                    ranked, shared = (torch.stack([part[index] for index in indices]) for part in (middle, shares))
                kept = top_slots_per_head(ranked, shared, recent, sinks, most)  # [V',1,Hc,T]
                for index, kept_by in zip(indices, kept):
                    group[index].keep(kept_by, [count + recent + sinks for count in counts[index]])

    def count_ranked(self) -> None:
        """The budget of every pending selection that keeps what it ranks (``ranked``): counted for those of one shape
        and reserved slots at once, and read back together (one host synchronisation a layer, not one a variant)."""
        groups: dict[tuple, list[Pending]] = defaultdict(list)
        for pending in self.pending:
            if pending.ranked:
                groups[pending.scores.shape, pending.slots[1:]].append(pending)
        counts = [ranked_counts(torch.stack([p.scores for p in group]), *slots) for (_, slots), group in groups.items()]
        read = iter(torch.cat(counts).tolist() if counts else [])
        for group in groups.values():
            for pending in group:
                _, recent, sinks = pending.slots
                pending.slots, pending.ranked = (sinks + recent + next(read), recent, sinks), False

    def settle(self) -> None:
        """Compute what the variants so far asked of the layer's windows together (SLAKE's VABS preferences)."""
        for stats in self.windows.values():
            stats.settle()

    def select(self) -> None:
        """Every pending selection, by one top-k for those of one shape and slots (:func:`top_slots` over their scores
        stacked ``[V,B,Hc,T]``: slice by slice the same top-k as each variant's alone), their rankings then gathered
        by one gather and, where they select from one prompt's entries (the same tensors), its keys and values and
        its positions by one gather each: each selection's a view of one buffer of them all, which a variant's first
        append copies out of (:func:`~kvbench.engine.layer.appended` writes in place only into a storage of its
        own), and so are the entries they drop where attending modifiers are handed them (:meth:`drop`); else each
        selection's by its own. Each is then kept by its variants."""
        self.settle()
        self.select_heads()
        self.count_ranked()
        groups: dict[tuple, list[Pending]] = defaultdict(list)
        for pending in self.pending:
            groups[pending.scores.shape, pending.scores.dtype, pending.slots].append(pending)
        self.pending, self.pending_keys = [], {}
        for (*_, slots), group in groups.items():
            scores = torch.stack([pending.scores for pending in group]).float()  # [V,B,Hc,T]
            kept = top_slots(scores, *slots)  # [V,B,Hc,K]
            rankings = scores.gather(-1, kept)  # what each variant's layer keeps as its ranking
            batch, heads, tokens = scores.shape[1:]
            flat = (kept + slot_offsets(batch, heads, tokens, kept.device)).flatten(1)  # [V,B·Hc·K]
            positions = [pending.entries[2] for pending in group]
            one_prompt = all(same_view(each, positions[0]) for each in positions)
            if one_prompt:  # one prompt's positions: gathered at once
                positions = list(positions[0].expand(len(group), -1, -1, -1).gather(-1, kept))
            else:
                positions = [each.gather(2, slots_kept) for each, slots_kept in zip(positions, kept)]
            keys, values, _ = group[0].entries
            if all(same_view(p.entries[0], keys) and same_view(p.entries[1], values) for p in group):
                taken = list(zip(*take_flat(flat, keys, values)))  # [V] of (keys, values [B,Hc,K,D])
                if one_prompt:
                    self.drop(group, kept, scores)
            else:
                taken = [take_flat(index, *pending.entries[:2]) for index, pending in zip(flat, group)]
            for slots_kept, entries, ranking, at, pending in zip(kept, taken, rankings, positions, group):
                gathered = (*entries, at, ranking)
                for keep in pending.keeps:
                    keep(slots_kept, gathered)

    def drop(self, group: list[Pending], kept: torch.Tensor, scores: torch.Tensor) -> None:
        """The entries that the selections ``kept [V,B,Hc,K]`` of ``group`` (one prompt's entries, ranked by ``scores
        [V,B,Hc,T]``) drop, for those with a key whose variants hand them on (``drops``): into :attr:`evicted` by the
        key, each as :func:`~kvbench.engine.layer.dropped` gives it alone, by one sort, gather and take for all."""
        chosen = [index for index, pending in enumerate(group) if pending.drops and pending.key is not None]
        if not chosen:
            return
        if len(chosen) < len(group):  # views of the chosen, stacked (an index tensor would be a copy from the host)
            kept, scores = (torch.stack([each[index] for index in chosen]) for each in (kept, scores))
        batch, heads, tokens = scores.shape[1:]
        index = dropped_slots(kept, tokens)  # [V',B,Hc,E]
        keys, values, positions = group[0].entries
        at = positions.expand(len(chosen), -1, -1, -1).gather(-1, index)
        ranking = scores.gather(-1, index)
        flat = (index + slot_offsets(batch, heads, tokens, index.device)).flatten(1)  # [V',B·Hc·E]
        dropped_keys, dropped_values = take_flat(flat, keys, values)  # [V',B,Hc,E,D]
        for place, chosen_index in enumerate(chosen):
            key = group[chosen_index].key
            assert key is not None  # chosen so
            self.evicted[key] = Evicted(dropped_keys[place], dropped_values[place], at[place], ranking[place])


@dataclass
class Pending:
    """A selection the variants of a shared forward wait for (:meth:`SharedForward.pend`): ``scores [B,Hc,T]``,
    ``slots`` (budget, recent, sinks), the ``entries`` it gathers and each variant's ``keeps``."""

    scores: torch.Tensor
    slots: tuple[int, int, int]
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    keeps: list[Callable[[torch.Tensor, tuple[torch.Tensor, ...]], None]] = field(default_factory=list)
    ranked: bool = False  # its budget still to count (whole chunks: :meth:`SharedForward.count_ranked`)
    key: tuple | None = None  # the selection's key, where it has one
    drops: bool = False  # a variant hands the dropped entries on (:meth:`SharedForward.drop`)


def same_view(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two tensors view the same elements of one storage the same way (the same values, whatever they are)."""
    return (
        tensor.data_ptr() == other.data_ptr()
        and tensor.shape == other.shape
        and tensor.stride() == other.stride()
        and tensor.dtype == other.dtype
        and tensor.device == other.device
    )


@dataclass
class PendingHeads:
    """A head-wise selection a variant waits for (:meth:`SharedForward.pend_heads`)."""

    policy: Policy
    scores: torch.Tensor
    slots: tuple[int, int, int]
    keep: Callable[[torch.Tensor, list[int]], None]
