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


def local_data(variable: str, *shared: str) -> Path:
    """Test data the user points to with the environment ``variable`` (as kvbench's task files read it), else
    the workplace's copy beside the project (``../shared/<shared...>``); callers skip when it is absent."""
    return Path(os.environ.get(variable) or PROJECT_ROOT.parent.joinpath("shared", *shared))
