"""The eviction-aware engine: budgeted KV cache, the kvbench attention function, prefill/decode loops."""

from kvbench.engine.engine import Engine
from kvbench.engine.runner import CACHE_SETTINGS, ENGINE_SETTINGS, REGIMES, GenerationOutput, PerplexityOutput

__all__ = ["CACHE_SETTINGS", "ENGINE_SETTINGS", "REGIMES", "Engine", "GenerationOutput", "PerplexityOutput"]
