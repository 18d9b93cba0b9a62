"""The engine's settings and their domains (``engine.<key>``, ``cache.<key>``; defaults in conf/config.yaml), apart
from the engine itself, so that what resolves and checks a job (:mod:`kvbench.job`, a sweep's launcher) reads them
without importing the model code."""

from __future__ import annotations

from kvbench.domains import FLAG, Domain, choice, integer, is_int, optional
from kvbench.engine.kivi import QUANT
from kvbench.engine.threads import THREADS

REGIMES = ["oneshot", "chunked", "streaming"]
#: ``engine.rows_attention``: how a decode step attends its rows, each by its own backend call, or those with every
#: key held by one padded SDPA call per layer (:func:`~kvbench.engine.attention.padded_outputs`), or those that only
#: append and attend held together, one scatter and one SDPA call per layer (:mod:`~kvbench.engine.store`); ``auto``:
#: :func:`~kvbench.engine.runner.rows_attention_on`
ROWS_ATTENTION = ["auto", "each", "padded", "stored"]
#: ``engine.sums_kernel``: how a running policy's sums are gathered, block by block in PyTorch or by one fused Triton
#: pass (:mod:`kvbench.kernels.sums`: on CUDA, or on CPU under ``TRITON_INTERPRET=1``); ``auto``:
#: :func:`~kvbench.engine.runner.sums_kernel_on`
SUMS_KERNELS = ["auto", "torch", "triton"]


def evicts_decoding(regime: str, decode_evict: bool | None) -> bool:
    """Whether the cache evicts while it decodes: ``engine.decode_evict``, by default every regime but oneshot."""
    return regime != "oneshot" if decode_evict is None else decode_evict


#: the engine settings (``engine.<key>``, defaults in conf/config.yaml) and their domains
ENGINE_SETTINGS: dict[str, Domain] = {
    "regime": choice(*REGIMES),
    "block_size": integer(1, "a token count"),
    "decode_evict": optional(FLAG, "the regime's: false for oneshot, true for chunked and streaming"),
    "decode_interval": integer(1, "a token count"),
    "score_block": Domain("auto or a query count ≥ 1", lambda value: value == "auto" or (is_int(value) and value >= 1)),
    "save_kept": FLAG,
    "batch_size": Domain("auto or a row count ≥ 1", lambda value: value == "auto" or (is_int(value) and value >= 1)),
    "threads": THREADS,
    "rows_attention": choice(*ROWS_ATTENTION),
    "sums_kernel": choice(*SUMS_KERNELS),
}


#: how the cache holds its entries once the prompt is read (``cache.<key>``, conf/config.yaml; :class:`Kivi`)
CACHE_SETTINGS: dict[str, Domain] = {
    "quant": choice(*QUANT),
    "group_size": integer(1, "a count of values"),
    "residual": integer(1, "a token count"),
}
