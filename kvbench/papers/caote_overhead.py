"""Theoretical FLOP overhead of CAOTE and FastCAOTE relative to the model forward (CAOTE Appendix E, Table 6).

Appendix E counts, for sequence length ``s``, hidden size ``d``, KV hidden size ``d_KV = H_kv · d_head``,
intermediate size ``d_FFN``, vocabulary ``d_V`` and ``L`` layers::

    prefill    2·L·s·d·(d + d_KV + d_FFN + 2s + 6) + d·d_V     (53)
    generation 2·L·d·(d + d_KV + d_FFN + 2s + 6) + d·d_V       (54)
    CAOTE      L·s·(7d + 3)                                    (55)
    FastCAOTE  L·s·(4d + 3) + L                                (56)

and Table 6 prints CAOTE (FastCAOTE) FLOPs divided by prefill (a) or generation (b) FLOPs for Llama-3.1-8B.

Discrepancy: Table 6b is reproduced by (54)–(56) to every printed digit; Table 6a is not reproduced by (53)
(at s = 4k/8k/32k, (53) gives 1.27e-4/9.76e-5/4.12e-5 against the printed 1.6e-4/9.25e-5/6.45e-5, and no
affine-in-s prefill count fits the three rows). All six printed 6a numbers equal instead
``generation_ratio(s) / s`` — CAOTE FLOPs over ``s ×`` (54), i.e. (53) with the LM head applied to every
prompt token — at s = 512, 8192 and 16384 for the rows labelled 4k, 8k and 32k. ``caote_overhead`` implements
the equations as printed; ``tests/test_overhead.py`` checks both findings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvbench.errors import KVBenchError

#: Llama-3.1-8B, the model of CAOTE Table 6 (its HF config.json).
LLAMA_3_1_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "head_dim": 128,
}


class Table6Entry(NamedTuple):
    """One printed row of CAOTE Table 6: overhead ratios at a labelled sequence length."""

    phase: str  # "prefill" (Table 6a) or "generation" (Table 6b)
    seq_len: int  # as labelled ("4k" = 4096)
    caote: float  # CAOTE FLOPs / phase FLOPs, as printed
    fastcaote: float  # FastCAOTE FLOPs / phase FLOPs, as printed


#: CAOTE Table 6 ("Compute overhead ratios for CAOTE and FastCAOTE"), Llama-3.1-8B, numbers as printed.
TABLE6 = (
    Table6Entry("prefill", 4096, 1.6e-4, 8.9e-5),
    Table6Entry("prefill", 8192, 9.25e-5, 5.28e-5),
    Table6Entry("prefill", 32768, 6.45e-5, 3.69e-5),
    Table6Entry("generation", 512, 0.08, 0.046),
    Table6Entry("generation", 1024, 0.15, 0.087),
)


def _field(config: Any, name: str, default: int | None = None) -> int:
    """Read ``name`` from a mapping or an object with attributes (e.g. a transformers ``PretrainedConfig``)."""
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is None:
        if default is None:
            raise KVBenchError(f"model config has no {name!r}")
        return default
    return int(value)


def caote_overhead(model_config: Any, seq_len: int) -> dict[str, float]:
    """FLOPs of the forward pass, CAOTE and FastCAOTE at ``seq_len`` tokens, and their ratios (App. E).

    ``model_config`` needs ``hidden_size``, ``num_hidden_layers``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size`` and ``head_dim`` (default ``hidden_size / num_attention_heads``).
    Returns ``prefill_flops`` (53), ``generation_flops`` (54), ``caote_flops`` (55), ``fastcaote_flops`` (56)
    and ``{caote,fastcaote}_{prefill,generation}_ratio`` (Table 6's quantities).
    """
    d = _field(model_config, "hidden_size")
    layers = _field(model_config, "num_hidden_layers")
    head_dim = _field(model_config, "head_dim", default=d // _field(model_config, "num_attention_heads"))
    d_kv = _field(model_config, "num_key_value_heads") * head_dim
    d_ffn = _field(model_config, "intermediate_size")
    d_vocab = _field(model_config, "vocab_size")
    s = seq_len

    per_token = 2 * layers * d * (d + d_kv + d_ffn + 2 * s + 6)
    prefill = s * per_token + d * d_vocab  # CAOTE eq. (53)
    generation = per_token + d * d_vocab  # CAOTE eq. (54)
    caote = layers * s * (7 * d + 3)  # CAOTE eq. (55)
    fastcaote = layers * s * (4 * d + 3) + layers  # CAOTE eq. (56)
    return {
        "prefill_flops": prefill,
        "generation_flops": generation,
        "caote_flops": caote,
        "fastcaote_flops": fastcaote,
        "caote_prefill_ratio": caote / prefill,
        "fastcaote_prefill_ratio": fastcaote / prefill,
        "caote_generation_ratio": caote / generation,
        "fastcaote_generation_ratio": fastcaote / generation,
    }
