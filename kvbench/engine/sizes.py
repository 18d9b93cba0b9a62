"""What a sample's cache measured: its sizes after prefill and at their peak (``GenerationOutput.kv``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CacheSizes:
    """Cache sizes measured during one sample (tokens per KV head, on average where each head holds its own length;
    bytes over all layers): ``after_prefill_head_range`` each layer's shortest and longest head after prefill, where
    the heads' lengths differ (a head-wise eviction), else None."""

    after_prefill_tokens_per_layer: list[int] = field(default_factory=list)
    peak_tokens_per_layer: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    full_bytes: int = 0
    after_prefill_bytes: int = 0
    after_prefill_head_range: list[list[int]] | None = None

    @classmethod
    def held(cls, layers: Sequence[Any]) -> CacheSizes:
        """What a cache's ``layers`` (:class:`~kvbench.engine.layer.EvictionLayer`) hold now, as after prefill: tokens
        per head of each layer, bytes, and each layer's range of head lengths where they differ."""
        ranges = [[min(lengths), max(lengths)] for lengths in (layer.held_per_head() for layer in layers)]
        return cls(
            after_prefill_tokens_per_layer=[layer.tokens_per_head() for layer in layers],
            after_prefill_bytes=sum(layer.held_bytes() for layer in layers),
            after_prefill_head_range=ranges if any(low != high for low, high in ranges) else None,
        )
