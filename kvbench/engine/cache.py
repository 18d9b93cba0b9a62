"""A budgeted KV cache on transformers' ``Cache`` API.

Every layer stores, per cache head, the kept keys/values and their absolute token positions; eviction
gathers the kept entries into smaller tensors, so memory really shrinks. The cache is always ordered by
position within a head (kept indices are sorted and new tokens are appended), so the most recent
``r`` tokens of a head are its last ``r`` slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvbench.policies.base import AttentionStats, Policy


class EvictionLayer(DynamicLayer):
    """One layer's cache: ``keys``/``values [B,Hc,T,D]``, ``positions [B,Hc,T]`` and scoring state.

    ``Hc`` is the number of KV heads, or of query heads in the KV-repeated layout. ``accumulated [B,Hc,T]``
    holds the running score of accumulating policies (H2O); ``recent_queries [B,Hq,W,D]`` the last
    ``W`` queries for window policies (SnapKV's observation window, TOVA's last query).
    """

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.accumulated: torch.Tensor | None = None
        self.recent_queries: torch.Tensor | None = None
        self.recent_query_positions: torch.Tensor | None = None
        self.peak_tokens = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        """Append this forward's tokens (``positions [q]``) and grow the per-token state to match."""
        super().update(keys, values)
        batch, heads, new_tokens, _ = keys.shape
        new_positions = positions.to(keys.device).expand(batch, heads, new_tokens)
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], -1)
        if self.accumulated is not None:
            zeros = self.accumulated.new_zeros(batch, heads, new_tokens)
            self.accumulated = torch.cat([self.accumulated, zeros], dim=-1)
        self.peak_tokens = max(self.peak_tokens, self.get_seq_length())

    def remember_queries(self, queries: torch.Tensor, positions: torch.Tensor, window: int):
        """Keep the last ``window`` queries ``[B,Hq,W,D]`` (and their positions) for window scoring."""
        if self.recent_queries is not None:
            queries = torch.cat([self.recent_queries, queries], dim=2)
            positions = torch.cat([self.recent_query_positions, positions])
        self.recent_queries = queries[:, :, -window:]
        self.recent_query_positions = positions[-window:]

    def keep(self, kept: torch.Tensor):
        """Gather the kept slots ``kept [B,Hc,K]`` (sorted) into new, smaller tensors."""
        slots = kept[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, slots)
        self.values = self.values.gather(2, slots)
        self.positions = self.positions.gather(2, kept)
        if self.accumulated is not None:
            self.accumulated = self.accumulated.gather(2, kept)


@dataclass
class KVStats:
    """Cache sizes measured during one sample (tokens per KV head, bytes over all layers)."""

    after_prefill_tokens_per_layer: list[int] = field(default_factory=list)
    peak_tokens_per_layer: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    full_bytes: int = 0


class EvictionCache(Cache):
    """A ``Cache`` whose layers are evicted to per-layer budgets by a ``Policy``.

    The engine calls :meth:`begin_forward` before each model forward with the absolute positions of the
    new tokens and whether this forward evicts; the kvbench attention function calls :meth:`update`
    (through the model) and then :meth:`after_attention`, where scores are gathered and layers evicted.
    """

    def __init__(
        self,
        policy: Policy,
        layer_budgets: list[int],
        prompt_len: int,
        num_query_heads: int,
        num_kv_heads: int,
        attn_backend: str = "sdpa",
        score_block: int = 256,
    ):
        super().__init__(layers=[EvictionLayer() for _ in layer_budgets])
        self.policy = policy
        self.layer_budgets = layer_budgets
        self.prompt_len = prompt_len
        self.num_query_heads = num_query_heads
        self.repeat_layout = policy.gqa == "repeat"
        self.cache_heads = num_query_heads if self.repeat_layout else num_kv_heads
        self.attn_backend = attn_backend
        self.score_block = score_block
        self.new_positions: torch.Tensor | None = None
        self.evict_now = False
        self.track_scores = False
        self.live_bytes = [0] * len(layer_budgets)
        self.peak_bytes = 0

    # -- called by the engine --------------------------------------------------------------------------
    def begin_forward(self, positions: torch.Tensor, evict: bool, track_scores: bool):
        """Declare the next forward: ``positions [q]`` of its tokens, whether to evict after it, and
        whether accumulating policies must add its queries' contributions (i.e. eviction may follow)."""
        self.new_positions = positions
        self.evict_now = evict
        self.track_scores = track_scores

    def tokens_per_layer(self) -> list[int]:
        return [layer.get_seq_length() for layer in self.layers]

    # -- called by the model / attention function ------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Append new keys/values ``[B,Hkv,q,D]`` (repeated to query heads in the repeat layout)."""
        if self.repeat_layout:
            group = self.num_query_heads // key_states.shape[1]
            key_states = key_states.repeat_interleave(group, dim=1)
            value_states = value_states.repeat_interleave(group, dim=1)
        layer: EvictionLayer = self.layers[layer_idx]
        if self.policy.accumulates and self.track_scores and layer.accumulated is None:
            batch, heads, _, _ = key_states.shape
            layer.accumulated = key_states.new_zeros(batch, heads, 0, dtype=torch.float32)
        layer.append(key_states, value_states, self.new_positions)
        self._account(layer_idx)
        return layer.keys, layer.values

    def after_attention(self, layer_idx: int, queries: torch.Tensor, scaling: float):
        """Gather this forward's scoring statistics (``queries [B,Hq,q,D]``) and evict if due."""
        policy, layer = self.policy, self.layers[layer_idx]
        budget = self.layer_budgets[layer_idx]
        if policy.needs_attention:
            if policy.accumulates:
                if self.track_scores:
                    positions = self.new_positions.to(queries.device)
                    stats = AttentionStats(queries, layer.keys, layer.values, positions, layer.positions, scaling)
                    layer.accumulated += policy.summed_contributions(stats, self.score_block)
            else:
                window = policy.scoring_window(budget, self.prompt_len)
                layer.remember_queries(queries, self.new_positions.to(queries.device), window)
        if self.evict_now and policy.evicts and layer.get_seq_length() > budget:
            self._evict(layer_idx, scaling)

    # -- internals -------------------------------------------------------------------------------------
    def _evict(self, layer_idx: int, scaling: float):
        """Keep the top ``budget`` slots per cache head: reserved sinks/recent tokens first, then by score."""
        policy, layer = self.policy, self.layers[layer_idx]
        budget = self.layer_budgets[layer_idx]
        tokens = layer.get_seq_length()
        recent = min(policy.reserved_recent(budget, self.prompt_len), budget)
        if not policy.needs_attention:
            scores = policy.position_scores(layer.positions)
        else:
            if policy.accumulates:
                summed = layer.accumulated
            else:
                stats = AttentionStats(
                    layer.recent_queries, layer.keys, layer.values, layer.recent_query_positions, layer.positions, scaling
                )
                summed = policy.summed_contributions(stats, self.score_block)
            scores = policy.rank(summed, layer.values, recent)
        slot = torch.arange(tokens, device=scores.device)
        reserved = (layer.positions < policy.reserved_sinks()) | (slot >= tokens - recent)
        scores = scores.float().masked_fill(reserved, float("inf"))
        kept = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
        layer.keep(kept)
        self._account(layer_idx)

    def _account(self, layer_idx: int):
        layer = self.layers[layer_idx]
        self.live_bytes[layer_idx] = layer.keys.numel() * layer.keys.element_size() * 2
        self.peak_bytes = max(self.peak_bytes, sum(self.live_bytes))

    # -- transformers Cache API --------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0
