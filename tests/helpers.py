"""Small builders shared by the tests: tiny random models, prompts and engines over them."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvbench import PROJECT_ROOT
from kvbench.engine import Engine
from kvbench.policies import build_policy

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(architecture: str = "llama", seed: int = 0, layers: int = 3, vocab: int = 300, **overrides):
    """A randomly initialised GQA model (4 query heads, 2 KV heads) with non-flat attention."""
    config_class, model_class = ARCHITECTURES[architecture]
    settings = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return model_class(config_class(**settings)).eval()


def random_prompt(length: int, vocab: int = 300, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def engine(model, spec="full", budget=64, regime="oneshot", **params) -> Engine:
    """An engine for ``spec`` (its parameters as keywords) with 16-token chunks."""
    return Engine(model, build_policy(spec, params), budget, regime=regime, block_size=16)


def checked_evictions(monkeypatch, verdict) -> list[bool]:
    """Every eviction's ``verdict(layer_idx, keys, values, kept, budget)``: the layer's cache before it (``keys``/
    ``values [Hc,T,D]`` float64, row 0) and the slots it kept, a mask ``kept [Hc,T]``."""
    from kvbench.engine.cache import EvictionCache

    evictions: list[bool] = []
    original = EvictionCache._evict

    def checked(cache, layer_idx, budget, scores, scaling):
        layer = cache.eviction_layers[layer_idx]
        keys, values, positions = layer.keys[0].double(), layer.values[0].double(), layer.positions[0].clone()
        original(cache, layer_idx, budget, scores, scaling)
        kept = torch.stack([torch.isin(positions[h], layer.positions[0, h]) for h in range(positions.shape[0])])
        evictions.append(bool(verdict(layer_idx, keys, values, kept, budget)))

    monkeypatch.setattr(EvictionCache, "_evict", checked)
    return evictions


def prefill_and_decode(runner: Engine, prompt: list[int], steps: int = 4):
    """A cache for ``prompt`` prefilled by ``runner``, then ``steps`` tokens decoded (evicting where the regime does
    while decoding: chunked, streaming)."""
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    for step in range(steps):
        runner.step(cache, [7 + step], len(prompt) + step, evict=runner.decode_evict)
    return cache


def local_data(variable: str, *shared: str) -> Path:
    """Test data the user points to with the environment ``variable`` (as kvbench's task files read it), else
    the workplace's copy beside the project (``../shared/<shared...>``); callers skip when it is absent."""
    return Path(os.environ.get(variable) or PROJECT_ROOT.parent.joinpath("shared", *shared))
