"""What a policy's score reads and what an eviction hands an attending modifier: the data of the policy contract
(``kvbench.policies.base``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from kvbench.errors import KVBenchError
from kvbench.policies.stats import AttentionStats, T, memoised

#: the attention statistic a policy scores from (:attr:`~kvbench.policies.base.Policy.statistic`):
#: ``positions`` none (newer ranks higher: full, sink); ``entries`` none either: the score reads the cached keys
#: and values themselves (:class:`ScoreContext`; KNorm); ``window`` the attention of the last ``scoring_window``
#: queries over the cache, gathered when it evicts (SnapKV, TOVA, PyramidKV);
#: ``queries`` those queries themselves, no attention computed (their statistics
#: model the queries to come: Expected Attention); ``running`` every scored query's contributions summed as it is
#: seen (H2O eq. 2); ``reconstruction`` the most attention each slot of a context receives while the model, asked
#: to repeat the context, reads it back chunk by chunk (KVzip: every layer scored before any evicts). How the cache
#: computes a running sum (from the attention weights, or in one pass from each query's normaliser beside the
#: backend's attention output) is the cache's choice (``kvbench.engine.scoring.uses_normaliser``), not the policy's.
Statistic = Literal["positions", "entries", "window", "queries", "running", "reconstruction"]
#: the statistics that are attention scores, which a non-attending modifier re-ranks
ATTENTION: tuple[Statistic, ...] = ("window", "running")


@dataclass(frozen=True)
class LayerWeights:
    """The weights of one attention layer that a score may read, as the model stores them (no copy):
    ``output`` the output projection ``W_O [hidden, Hq·D]`` (``o_proj.weight``) and ``rotary`` the model's rotary
    embedding (``(x, position_ids) → (cos, sin)``, Hugging Face's ``rotary_emb``), or None."""

    output: torch.Tensor
    query_heads: int
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def output_per_head(self) -> torch.Tensor:
        """``W_O`` per query head ``[Hq,D,hidden]``: head ``h``'s attention output ``o_h [D]`` adds
        ``o_h @ W_O[h]`` to the layer's output (a view)."""
        return self.output.T.unflatten(0, (self.query_heads, -1))

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's float32 ``cos``/``sin [N,D]`` at ``positions [N]``: position ``p`` rotates a query or key ``x`` to
        ``x·cos + rotate_half(x)·sin``."""
        if self.rotary is None:
            raise KVBenchError("this model has no rotary embedding (rotary_emb) for a score to read")
        probe = self.output.new_empty(0, dtype=torch.float32)
        cos, sin = self.rotary(probe, positions.to(self.output.device)[None])
        if 2 * cos.shape[-1] == self.output.shape[1] // self.query_heads:  # one per pair (GPT-OSS's): both halves
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos[0].float(), sin[0].float()


@dataclass
class ScoreContext:
    """What :meth:`Policy.score` ranks one layer's cached slots from (B batch, Hc cache heads, T slots, D head
    dim). Every field refers to what the cache holds, or has gathered for the statistic the policy declared:
    nothing is computed for a policy that does not read it.

    * ``keys``/``values [B,Hc,T,D]``: the cached entries as stored (keys after RoPE), in the cache's head layout
      (``Hc``: the KV heads, or the query heads with ``gqa=repeat``); ``positions [B,Hc,T]`` their token positions;
    * ``summed [B,Hc,T]``: the declared statistic summed per cache head (``window``, ``running``; ``reconstruction``
      its maximum), else None;
    * ``window``: the ``window`` or ``queries`` statistic's :class:`AttentionStats` (its queries ``[B,Hq,W,D]``,
      and lazily their weights, logits and outputs), else None;
    * ``recent``/``sinks``: the number of slots at the end / start that the policy reserves, ``budget`` the slots
      the layer keeps per cache head (the reserved included; 0 where unknown);
    * ``weights``: the layer's :class:`LayerWeights` (None in a cache built without a model);
    * ``shared``: where the variants of a shared prefill score the same entries, what they computed from the entries
      alone (:meth:`once`), else None;
    * ``next_position``: the position the next token takes (the tokens the forwards declared, counted on the host),
      or None: one past the newest cached position; ``layer`` the layer's index;
    * ``score_key``: where the base's score is shared by a shared prefill's variants (and no modifier re-ranked it
      yet), the key it is shared under, else None (:meth:`of_score`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    summed: torch.Tensor | None
    recent: int
    window: AttentionStats | None = None
    weights: LayerWeights | None = None
    sinks: int = 0
    budget: int = 0
    shared: dict[Hashable, Any] | None = None
    next_position: int | None = None
    layer: int = 0
    score_key: Hashable | None = None

    def once(self, name: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, a function of the entries and the layer's weights alone (not of the budget or the
        statistic): in a shared prefill computed by the first variant that asks for ``name``, then read by the rest."""
        return compute() if self.shared is None else memoised(self.shared, name, compute)

    def of_score(self, name: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, a function of the entries and of the score a modifier re-ranks alone (not of the budget):
        where that score is a shared prefill's shared base score (``score_key``), computed by the first variant that
        asks for ``name``, then read by the rest."""
        if self.shared is None or self.score_key is None:
            return compute()
        return memoised(self.shared, (self.score_key, name), compute)


def take_slots(index: torch.Tensor, *entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``entries [B,H,T,D]`` (keys, values: one shape) at the slots ``index [B,H,K]`` → ``[B,H,K,D]``, as
    ``gather`` along the slots: one ``index_select`` of each as ``B·H·T`` rows by one flat index (a ``gather`` by an
    index expanded over ``D`` is up to 100× slower on CPU)."""
    batch, heads, tokens, _ = entries[0].shape
    return take_flat((index + slot_offsets(batch, heads, tokens, index.device)).flatten(), *entries)


def take_flat(flat: torch.Tensor, *entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`take_slots` by the flat index ``flat [..., B·H·K]`` of the slots (``index`` + :func:`slot_offsets`) →
    ``[..., B,H,K,D]``: several selections ``[V, B·H·K]`` of the same entries by one ``index_select``."""
    batch, heads, _, dim = entries[0].shape
    shape = (*flat.shape[:-1], batch, heads, -1, dim)
    # a reshape copies only where the slots are not contiguous
    return tuple(each.reshape(-1, dim).index_select(0, flat.flatten()).view(shape) for each in entries)


@functools.lru_cache(maxsize=256)
def slot_offsets(batch: int, heads: int, tokens: int, device: torch.device) -> torch.Tensor:
    """The first of each (sequence, head)'s ``tokens`` slots as ``B·H·T`` rows ``[B,H,1]``, made once (read only)."""
    return torch.arange(0, batch * heads * tokens, tokens, device=device).view(batch, heads, 1)


@dataclass
class Evicted:
    """Entries evicted from one layer, the same number ``E`` per cache head: ``keys``/``values [B,Hc,E,D]``,
    ``positions [B,Hc,E]`` and ``scores [B,Hc,E]`` (the policy's ranking they lost on)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor

    def __len__(self) -> int:
        return self.keys.shape[2]

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values, self.positions, self.scores

    def to(self, device) -> Evicted:
        return Evicted(*(tensor.to(device) for tensor in self.parts))

    def join(self, other: Evicted) -> Evicted:
        """This set followed by ``other`` (on this set's device)."""
        return Evicted(*(torch.cat([a, b], dim=2) for a, b in zip(self.parts, other.to(self.keys.device).parts)))

    def top(self, count: int) -> Evicted:
        """The ``count`` best-scored entries of every head."""
        return Evicted.taken(
            self.keys, self.values, self.positions, self.scores, self.scores.topk(count, dim=-1).indices
        )

    @staticmethod
    def taken(
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor,
        index: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> Evicted:
        """The entries at ``index [B,Hc,E]`` of a layer's ``positions`` and ``scores [B,Hc,T]`` and of its
        ``keys``/``values [B,Hc,T,D]``, there at ``slots`` where a deferred eviction has not gathered them yet."""
        slots = index if slots is None else slots
        kept_keys, kept_values = take_slots(slots, keys, values)
        return Evicted(kept_keys, kept_values, positions.gather(2, index), scores.gather(2, index))


def by_kv_head(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """View per-query-head rows ``[B,Hq,...]`` as ``[B,Hc,G,...]`` (query head ``h`` reads cache head ``h // G``)."""
    return query.view(query.shape[0], kv_heads, query.shape[1] // kv_heads, *query.shape[2:])


@runtime_checkable
class Calibrated(Protocol):
    """A policy calibrated once on the model before it runs (DuoAttention's head scores): the engine calls
    :meth:`calibrate` with the model, its tokenizer and the offline calibration text (the Paul Graham essays)."""

    def calibrate(self, model: Any, tokenizer: Any, text: str) -> None: ...

    def calibration_refusal(self, model: Any) -> str | None:
        """Why it cannot be calibrated on ``model`` (its skeleton on the meta device suffices: checked before the
        weights load), or None."""
        ...


def evicting_again(regime: str, decode_evict: bool) -> str | None:
    """The setting that evicts again after the prompt's eviction (``engine.regime=chunked|streaming``, or
    ``engine.decode_evict=true``), for a method that evicts once, after the prompt, to say why it refuses it; None
    where nothing does."""
    if regime != "oneshot":
        return f"engine.regime={regime}"
    return "engine.decode_evict=true" if decode_evict else None
