"""ThinK (``+think``): the prompt's key channels pruned per head after a token policy's eviction — against kvpress's
``ComposedPress([press, ThinKPress])`` (fixtures by scripts/kvpress_fixtures.py), the cache really narrower, the
decode reading the pruned channels as zero, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbench.engine.engine import Engine
from kvbench.engine.kivi import Kivi, quant_refusal
from kvbench.models import load_model, model_config
from kvbench.policies import build_policy
from tests.helpers import (
    TOKENIZER,
    assert_equal_up_to_near_ties,
    engine,
    kept_masks,
    random_prompt,
    recorded_rankings,
    tiny_model,
    unpacked_mask,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kvpress"
#: fixture → (spec, settings giving kvpress's convention)
REFERENCES = {
    "snapkv+think": ("snapkv+think", {"window": 64, "pruned": 0.5}),  # SnapKVPress's window
    "snapkv+think-p30": ("snapkv+think", {"window": 64, "pruned": 0.3}),  # 19.2 of 64 channels: 19 pruned
    "knorm+think-p25": ("knorm+think", {"norm_bits": None, "pruned": 0.25}),
}


@pytest.mark.model
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_kept_sets_and_channels_equal_kvpress(name):
    """Every layer and KV head keeps the press's positions (up to scores tied within float32 rounding) and prunes the
    press's key channels (3 prompts × 30 layers × 3 heads)."""
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    spec, settings = REFERENCES[name]
    model = load_model(model_config("smollm2_135m")).model
    runner = Engine(model, build_policy(spec, settings), fixture["kept"], "oneshot")
    for prompt in fixture["prompts"]:
        ids = prompt["ids"]
        cache = runner.new_cache(len(ids))
        with recorded_rankings() as rankings:
            runner.prefill(cache, ids)
        cache.end_prefill()
        for number, (layer, kept, masked, pruned) in enumerate(
            zip(cache.eviction_layers, kept_masks(cache, len(ids)), prompt["kept_masks"], prompt["pruned_channels"])
        ):
            heads, dim = kept.shape[0], layer.pruned.dim
            theirs = unpacked_mask(masked, heads, len(ids))
            assert_equal_up_to_near_ties(kept, theirs, rankings[number], f"{name} layer {number}")
            ours = torch.ones(heads, dim, dtype=torch.bool).scatter_(-1, layer.pruned.channels[0], False)
            assert torch.equal(ours, unpacked_mask(pruned, heads, dim))
            assert int(ours.sum(-1).max()) == int(dim * settings["pruned"])


def prefilled(spec: str, prompt: list[int], budget: int = 24, **settings):
    runner = engine(tiny_model(layers=3), spec, budget, window=8, **settings)
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    return runner, cache


def test_held_narrower_and_attended_as_zero():
    """The prompt's keys are held in the kept channels only (their bytes, and the indices, are what the layer
    counts); attention reads every kept key with the pruned channels zero, and a decoded key whole."""
    prompt = random_prompt(60)
    _, plain = prefilled("snapkv", prompt)
    runner, pruned = prefilled("snapkv+think", prompt, pruned=0.25)
    pruned.end_prefill()
    for before, layer in zip(plain.eviction_layers, pruned.eviction_layers):
        keys, dim = before.keys, before.keys.shape[-1]
        channels = layer.pruned.channels  # [1,Hc,D']
        assert layer.pruned.keys.shape == (*keys.shape[:3], dim - dim // 4)
        assert layer.keys.shape[2] == 0 and layer.get_seq_length() == keys.shape[2]
        zeroed = torch.zeros_like(keys).scatter_(-1, channels[:, :, None].expand_as(layer.pruned.keys), 1.0) * keys
        attended_keys, attended_values, _ = layer.attended()
        assert torch.equal(attended_keys, zeroed) and torch.equal(attended_values, before.values)
        entries = layer.pruned.keys.numel() * 4 + channels.numel() * 8 + before.values.numel() * 4
        assert layer.held_bytes() == entries < before.held_bytes()
    runner.step(pruned, [5], len(prompt), evict=False)
    assert all(
        layer.keys.shape[2] == 1 and layer.keys.shape[-1] == layer.pruned.dim for layer in pruned.eviction_layers
    )


def test_decode_equals_the_keys_zeroed():
    """Decoding from the pruned cache gives the logits of the same kept entries with the pruned channels zeroed in
    place (kvpress's form), step after step."""
    prompt = random_prompt(70, seed=3)
    runner, pruned = prefilled("snapkv+think", prompt)
    pruned.end_prefill()
    reference_runner, reference = prefilled("snapkv", prompt)
    for layer, zeroed in zip(pruned.eviction_layers, reference.eviction_layers):
        kept = torch.zeros_like(zeroed.keys[..., 0, :], dtype=torch.bool).scatter_(-1, layer.pruned.channels, True)
        zeroed.keys = zeroed.keys * kept[:, :, None]
    token = 9
    for step in range(5):
        ours = runner.step(pruned, [token], len(prompt) + step, evict=False)
        theirs = reference_runner.step(reference, [token], len(prompt) + step, evict=False)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        token = int(ours[0, -1].argmax())


def test_byte_budget_buys_more_tokens():
    """At ``0.25x`` a pruned cache keeps more tokens — its keys cost ``(D + D')/2D`` of a plain entry — and holds at
    most a quarter of the full cache's bytes after the prompt (the records' own count)."""
    model, prompt = tiny_model(), random_prompt(400)
    sizes = [
        Engine(model, build_policy(spec, {"window": 8}), "0.25x", tokenizer=TOKENIZER).generate(prompt, 1).kv
        for spec in ("snapkv", "snapkv+think")
    ]
    assert sizes[0].after_prefill_tokens_per_layer == [100] * 3
    assert all(130 <= tokens <= 134 for tokens in sizes[1].after_prefill_tokens_per_layer)  # 133 less the indices
    assert sizes[1].after_prefill_bytes <= 0.25 * sizes[1].full_bytes


@pytest.mark.parametrize(
    ("spec", "regime", "decode_evict", "says"),
    [
        ("snapkv+think", "streaming", False, "engine.regime=streaming"),
        ("snapkv+think", "oneshot", True, "engine.decode_evict=true"),
        ("snapkv+adakv+think", "oneshot", False, "adakv does not"),
        ("snapkv+calidrop+think", "oneshot", False, "calidrop does not"),
        ("duo_attention+think", "oneshot", False, "use it alone"),
        ("kvzip+think", "oneshot", False, "not a reconstruction's"),
    ],
)
def test_refusals(spec, regime, decode_evict, says):
    assert says in (build_policy(spec).refusal(regime, True, decode_evict) or "")


def test_refused_with_kivi():
    refusal = quant_refusal(Kivi(2), build_policy("snapkv+think"), decode_evict=False)
    assert refusal is not None and "prunes some" in refusal


def test_only_the_queries_it_reads_are_held_until_the_prompt_is_read():
    """Over Expected Attention (whose window is the whole prompt) a layer holds, once evicted, only ThinK's last
    ``window_size`` queries until it prunes, then none."""
    runner = engine(tiny_model(layers=3), "expected_attention+think", 24, window_size=8)
    cache = runner.new_cache(90)
    runner.prefill(cache, random_prompt(90))
    assert all(layer.recent_queries.shape[2] == 8 for layer in cache.eviction_layers)
    cache.end_prefill()
    assert all(layer.recent_queries is None and layer.pruned is not None for layer in cache.eviction_layers)
