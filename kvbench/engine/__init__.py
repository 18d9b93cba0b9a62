"""The eviction-aware engine: budgeted KV cache, the kvbench attention function, prefill/decode loops."""

from kvbench.engine.engine import REGIMES, Engine, GenerationOutput, PerplexityOutput

__all__ = ["REGIMES", "Engine", "GenerationOutput", "PerplexityOutput"]
