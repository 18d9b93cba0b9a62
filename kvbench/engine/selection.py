"""Selection, in one place: the slots each cache head keeps of a ranked layer — the reserved sinks (its first
slots) and recent window (its last), and the top-ranked of the slots between them."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvbench.kernels.decode import counting
from kvbench.policies.base import Policy


def reserved_slots(policy: Policy, tokens: int, budget: int, prompt_len: int) -> tuple[int, int]:
    """Of ``budget``, the recent window and the sinks every cache head of a layer of ``tokens`` slots keeps (the
    window first)."""
    recent = min(policy.reserved_recent(budget, prompt_len), budget)
    return recent, max(0, min(policy.reserved_sinks(), budget - recent, tokens - recent))


def kept_per_head(
    policy: Policy,
    scores: torch.Tensor,
    tokens: int,
    budget: int,
    prompt_len: int,
    per_head: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The slots kept ``[B,Hc,T]`` (True = kept) of a layer of ``tokens`` slots ranked by ``scores [B,Hc,T]``, where
    each cache head keeps its own share of ``budget × Hc`` (:meth:`~kvbench.policies.base.Policy.head_shares`) or
    ``per_head [B,Hc]``, of the slots it holds (``held``, where a head-wise layer was unpacked); else None."""
    if per_head is None and not policy.shares_heads:
        return None
    recent, sinks = reserved_slots(policy, tokens, budget, prompt_len)
    if per_head is not None:  # its sinks are among the head's slots, above every other
        sinks = min(policy.reserved_sinks(), tokens)
    middle = scores[..., sinks : tokens - recent].float()  # [B,Hc,M]
    shares = policy.head_shares(middle, budget, recent + sinks) if per_head is None else per_head - recent - sinks
    assert shares is not None  # the policy shares heads
    kept = top_slots_per_head(middle, shares, recent, sinks)
    return kept if held is None else kept & held


def top_slots(scores: torch.Tensor, budget: int, recent: int, sinks: int) -> torch.Tensor:
    """The ``budget`` slots kept per cache head, sorted ``[B,Hc,budget]``: ``sinks`` first slots, ``recent`` last
    ones and the top-ranked by ``scores [B,Hc,T]`` of the slots between them. The top-k runs over exactly those slots,
    as the reference implementations select heavy hitters (KVCache-Factory: ``topk(capacity − window)`` over the
    prefix), so ties break as there."""
    tokens = scores.shape[-1]
    heavy = scores[..., sinks : tokens - recent].float().topk(budget - recent - sinks, dim=-1).indices
    heavy = heavy + sinks if sinks else heavy  # [B,Hc,K']: slots of the whole layer
    if sinks + recent:
        reserved = reserved_index(sinks, tokens - recent, tokens, heavy.device)
        heavy = torch.cat([heavy, reserved.expand(*heavy.shape[:-1], -1)], dim=-1)
    return heavy.sort(dim=-1).values


def dropped_slots(kept: torch.Tensor, tokens: int) -> torch.Tensor:
    """The slots of ``tokens`` that keeping ``kept [...,K]`` drops ``[...,tokens − K]``, in slot order (any leading
    axes: several selections at once, each the same as alone)."""
    mask = torch.ones(*kept.shape[:-1], tokens, dtype=torch.bool, device=kept.device).scatter_(-1, kept, False)
    # a stable sort puts the dropped slots first, in slot order, with no host synchronisation
    return mask.byte().sort(dim=-1, descending=True, stable=True).indices[..., : tokens - kept.shape[-1]]


def ranked_budget(scores: torch.Tensor, recent: int, sinks: int) -> int:
    """What a policy that keeps only what it ranks (``keeps_ranked_only``: whole chunks) keeps of ``scores [B,Hc,T]``:
    its reserved slots and the fewest a head ranks (finite) between them (one value read back)."""
    return sinks + recent + int(ranked_counts(scores[None], recent, sinks)[0])


def ranked_counts(scores: torch.Tensor, recent: int, sinks: int) -> torch.Tensor:
    """The fewest slots a head of each ranking ``scores [V,B,Hc,T]`` ranks (finite) between its ``sinks`` first and
    ``recent`` last: ``[V]``."""
    return torch.isfinite(scores[..., sinks : scores.shape[-1] - recent]).sum(dim=-1).amin(dim=(1, 2))


@functools.lru_cache(maxsize=256)
def reserved_index(sinks: int, start: int, end: int, device: torch.device) -> torch.Tensor:
    """The slots ``0..sinks`` and ``start..end`` ``[sinks + end - start]``, made on ``device`` (slots made on the host
    and copied at each variant's layer would synchronise a GPU as often: a blocking copy from pageable memory), once
    for every variant and layer that reserves them (read, never written)."""
    return torch.cat([torch.arange(sinks, device=device), torch.arange(start, end, device=device)])


def top_slots_per_head(
    middle: torch.Tensor, shares: torch.Tensor, recent: int, sinks: int, most: int | None = None
) -> torch.Tensor:
    """The slots kept ``[B,Hc,T]`` (True = kept) where each cache head keeps its own ``shares [B,Hc]`` of the
    slots between its ``sinks`` and ``recent`` window, the top-ranked of them by ``middle [B,Hc,M]`` (the ranking of
    those slots alone: ``T = sinks + M + recent``); ``most``: the largest share (clamped to ``M``) where it was read
    back already (else read here)."""
    shares = shares.clamp(0, middle.shape[-1])  # [B,Hc]
    top = middle.topk(int(shares.max()) if most is None else most, dim=-1).indices  # [B,Hc,S]
    chosen = counting(top.shape[-1], top.device) < shares[..., None]  # a head keeps its first shares
    kept = torch.zeros_like(middle, dtype=torch.bool).scatter_(-1, top, chosen)  # [B,Hc,M]
    return F.pad(kept, (sinks, recent), value=True) if sinks + recent else kept
