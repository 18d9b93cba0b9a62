"""CAOTE Appendix E's FLOP counts: the model's forward in prefill and in generation, CAOTE's and FastCAOTE's
scoring, and their ratios — the quantities of CAOTE Table 6 (transcribed in ``caote_table6.csv``)::

    prefill    2·L·s·d·(d + d_KV + d_FFN + 2s + 6) + d·d_V     (53)
    generation 2·L·d·(d + d_KV + d_FFN + 2s + 6) + d·d_V       (54)
    CAOTE      L·s·(7d + 3)                                    (55)
    FastCAOTE  L·s·(4d + 3) + L                                (56)

for ``s`` tokens, hidden size ``d``, KV hidden size ``d_KV = H_kv · d_head``, intermediate size ``d_FFN``,
vocabulary ``d_V`` and ``L`` layers. tests/test_overhead.py compares them with the printed table: 6b to every printed
digit; 6a is not (53) but ``generation ratio / s`` at lengths other than those labelled (its docstring says which).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbench.errors import KVBenchError


def config_field(config: Any, name: str, default: int | None = None) -> int:
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
    d = config_field(model_config, "hidden_size")
    layers = config_field(model_config, "num_hidden_layers")
    head_dim = config_field(model_config, "head_dim", default=d // config_field(model_config, "num_attention_heads"))
    d_kv = config_field(model_config, "num_key_value_heads") * head_dim
    d_ffn = config_field(model_config, "intermediate_size")
    d_vocab = config_field(model_config, "vocab_size")
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
