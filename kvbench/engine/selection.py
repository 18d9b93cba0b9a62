"""Selection, in one place: the slots each cache head keeps of a ranked layer — the reserved sinks (its first
slots) and recent window (its last), and the top-ranked of the slots between them."""

from __future__ import annotations

import torch


def top_slots(scores: torch.Tensor, budget: int, recent: int, sinks: int) -> torch.Tensor:
    """The ``budget`` slots kept per cache head, sorted ``[B,Hc,budget]``: ``sinks`` first slots, ``recent`` last
    ones and the top-ranked by ``scores [B,Hc,T]`` of the slots between them. The top-k runs over exactly those slots,
    as the reference implementations select heavy hitters (KVCache-Factory: ``topk(capacity − window)`` over the
    prefix), so ties break as there."""
    tokens = scores.shape[-1]
    heavy = scores[..., sinks : tokens - recent].float().topk(budget - recent - sinks, dim=-1).indices + sinks
    reserved = torch.cat([torch.arange(sinks), torch.arange(tokens - recent, tokens)]).to(heavy.device)
    return torch.cat([heavy, reserved.expand(*heavy.shape[:-1], -1)], dim=-1).sort(dim=-1).values


def top_slots_per_head(middle: torch.Tensor, shares: torch.Tensor, recent: int, sinks: int) -> torch.Tensor:
    """The slots kept ``[B,Hc,T]`` (True = kept) where each cache head keeps its own ``shares [B,Hc]`` of the
    slots between its ``sinks`` and ``recent`` window, the top-ranked of them by ``middle [B,Hc,M]`` (the ranking of
    those slots alone: ``T = sinks + M + recent``)."""
    shares = shares.clamp(0, middle.shape[-1])  # [B,Hc]
    top = middle.topk(int(shares.max()), dim=-1).indices  # [B,Hc,S]
    chosen = torch.arange(top.shape[-1], device=top.device) < shares[..., None]  # a head keeps its first shares
    kept = torch.ones(*middle.shape[:-1], sinks + middle.shape[-1] + recent, dtype=torch.bool, device=middle.device)
    kept[..., sinks : kept.shape[-1] - recent] = torch.zeros_like(middle, dtype=torch.bool).scatter_(-1, top, chosen)
    return kept
