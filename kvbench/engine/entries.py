"""How a layer holds its entries other than as ``[B,Hc,T,D]`` tensors (:class:`~kvbench.engine.layer.EvictionLayer`):
packed with a length per head after a head-wise eviction, or with part of the keys' channels pruned."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HeadwiseEntries:
    """A layer's entries after a head-wise eviction (batch 1), packed head after head, each head's in position order:
    ``keys``/``values [N,D]``, ``positions [N]``, ``ranking [N]`` (the scores they were kept by), ``lengths [Hc]``
    (entries per cache head; ``counts`` the same on the host, read back once) and ``slots [N]``, each entry's place in
    the ``[Hc, longest]`` layout that attention pads them to (:meth:`padded`). The cache's bytes are the ``N`` entries
    kept, not the longest head's length × heads; attention's padded layout is a working copy beside them while the
    layer decodes (:meth:`EvictionLayer.attended`)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    ranking: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    longest: int
    counts: list[int]

    @staticmethod
    def packed(
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        ranking: torch.Tensor,
        kept: torch.Tensor,
        counts: list[int] | None = None,
    ) -> HeadwiseEntries:
        """The entries ``kept [1,Hc,T]`` (True = kept) of a layer's ``keys``/``values [1,Hc,T,D]``, ``positions`` and
        ``ranking [1,Hc,T]``, copied out of them; ``counts``: how many each head keeps, where known on the host."""
        heads = kept.shape[1]
        lengths = kept[0].sum(dim=-1)  # [Hc]
        if counts is None:  # the one read back (on a GPU a synchronisation; ``nonzero`` would be another)
            counts = lengths.tolist()
        longest = max(counts)
        # [N] head-major, slot order within a head: the kept slots first, in order (a stable sort)
        flat = kept[0].flatten().argsort(descending=True, stable=True)[: sum(counts)]
        # a kept slot's place in the layout: its head's first (h·longest) plus the kept slots before it in its head
        first = torch.arange(-1, heads * longest - 1, longest, device=kept.device)[:, None]  # [Hc,1], less one
        layout = kept[0].cumsum(dim=-1).add_(first).flatten()  # [Hc·T]
        return HeadwiseEntries(
            keys[0].flatten(0, 1)[flat],
            values[0].flatten(0, 1)[flat],
            positions[0].flatten()[flat],
            ranking[0].flatten()[flat],
            lengths,
            layout[flat],
            longest,
            counts,
        )

    @property
    def heads(self) -> int:
        return self.lengths.numel()

    def padded(self, entries: torch.Tensor) -> torch.Tensor:
        """``keys`` or ``values [N,D]`` in the padded layout ``[1,Hc,longest,D]`` (zeros after each head's own)."""
        layout = entries.new_zeros(self.heads * self.longest, entries.shape[-1])
        return layout.index_copy_(0, self.slots, entries).view(1, self.heads, self.longest, -1)

    def mask(self) -> torch.Tensor:
        """``[Hc, longest]``: True on each head's own entries of the padded layout."""
        return torch.arange(self.longest, device=self.lengths.device) < self.lengths[:, None]

    def by_head(self) -> list[torch.Tensor]:
        """Each cache head's positions."""
        return list(self.positions.split(self.counts))

    def unpacked(self, sinks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The entries in one ``[1,Hc,longest]`` layout for another eviction: ``keys``/``values [1,Hc,L,D]``,
        ``positions``, ``ranking`` and ``held [1,Hc,L]``. Each head's first ``sinks`` entries stay first and the rest
        end at the last slot, so that every head's sinks and recent window are the layout's first and last slots, as
        in an equal-length layer; the padding between them is not held and ranks −inf."""
        head = torch.arange(self.heads, device=self.slots.device).repeat_interleave(self.lengths)  # [N]
        rank = self.slots - head * self.longest  # each entry's place within its head
        shift = torch.where(rank < sinks, 0, self.longest - self.lengths[head])
        slots = self.slots + shift  # [N]

        def layout(entries: torch.Tensor, fill: float) -> torch.Tensor:
            flat = entries.new_full((self.heads * self.longest, *entries.shape[1:]), fill)
            return flat.index_copy_(0, slots, entries).view(1, self.heads, self.longest, *entries.shape[1:])

        held = layout(torch.ones_like(self.positions, dtype=torch.bool), False)
        ranking = layout(self.ranking, -torch.inf)
        return layout(self.keys, 0.0), layout(self.values, 0.0), layout(self.positions, 0), ranking, held


@dataclass
class PrunedKeys:
    """A layer's first keys with part of each head's channels pruned (ThinK, ``Modifier.key_channels``): ``keys
    [B,Hc,T,D']`` the channels ``channels [B,Hc,D']`` (ascending) of a head of ``dim`` channels."""

    keys: torch.Tensor
    channels: torch.Tensor
    dim: int

    def bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.channels.numel() * self.channels.element_size()

    def attended(self) -> torch.Tensor:
        """The keys ``[B,Hc,T,D]`` with the pruned channels zero (a working copy)."""
        index = self.channels[:, :, None].expand(-1, -1, self.keys.shape[2], -1)  # [B,Hc,T,D']
        return self.keys.new_zeros(*self.keys.shape[:3], self.dim).scatter_(-1, index, self.keys)
