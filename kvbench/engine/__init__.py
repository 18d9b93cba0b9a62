"""The eviction-aware engine: budgeted KV cache, the kvbench attention function, prefill/decode loops. Its names are
imported when first read (:func:`kvbench.lazy_exports`): reading the settings (:mod:`kvbench.engine.settings`) does not
import the model code."""

from typing import TYPE_CHECKING

from kvbench import lazy_exports

if TYPE_CHECKING:
    from kvbench.engine.engine import Engine
    from kvbench.engine.runner import GenerationOutput, PerplexityOutput

__all__ = ["Engine", "GenerationOutput", "PerplexityOutput"]
__getattr__ = lazy_exports(__name__, {"Engine": "engine", "GenerationOutput": "runner", "PerplexityOutput": "runner"})
