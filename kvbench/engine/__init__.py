"""The eviction-aware engine: budgeted KV cache, the kvbench attention function, prefill/decode loops."""

from kvbench.engine.engine import Engine
from kvbench.engine.runner import ENGINE_SETTINGS, REGIMES, GenerationOutput, PerplexityOutput

__all__ = ["ENGINE_SETTINGS", "REGIMES", "Engine", "GenerationOutput", "PerplexityOutput"]
