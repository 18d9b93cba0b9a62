"""What a sample's cache measured: its sizes after prefill and at their peak (``GenerationOutput.kv``)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
