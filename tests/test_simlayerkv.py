"""SimLayerKV beyond kvpress's fixtures (tests/test_kvpress_parity.py): the thresholds' limits against StreamingLLM and
the full cache, and its refusals."""

from __future__ import annotations

import pytest
import torch

from kvbench.policies import build_policy
from tests.helpers import engine, kept_masks, random_prompt, tiny_model


def kept(spec: str, settings: dict, budget: int, ids: list[int]) -> list[torch.Tensor]:
    runner = engine(tiny_model(layers=4), spec, budget, **settings)
    cache = runner.new_cache(len(ids))
    runner.prefill(cache, ids)
    return kept_masks(cache, len(ids))


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_every_layer_lazy_is_streaming_llm(budget):
    """At threshold 0 every layer is lazy: the first 4 tokens and the budget's recent rest, as ``sink``."""
    ids = random_prompt(90, seed=budget)
    lazy = kept("simlayerkv", {"lazy_threshold": 0.0}, budget, ids)
    streaming = kept("sink", {}, budget, ids)
    assert all(torch.equal(a, b) for a, b in zip(lazy, streaming))
    assert all(int(mask.sum(-1).max()) == budget for mask in lazy)


def test_no_layer_lazy_keeps_everything():
    """At threshold 1 (kvpress's default) no layer is lazy: every layer holds the prompt."""
    ids = list(range(3, 60))
    masks = kept("simlayerkv", {"lazy_threshold": 1.0}, 8, ids)
    assert all(bool(mask.all()) for mask in masks)


@pytest.mark.parametrize("length", [1, 9, 10, 11, 12])
@pytest.mark.parametrize("above", ["budget", "kvpress"])
def test_short_prompts_are_kept(length, above):
    """A prompt no longer than the budget is not evicted, nor with ``compress_above=kvpress`` one of up to ``budget +
    2·n_last`` tokens (kvpress: no compression up to its minimum)."""
    masks = kept("simlayerkv", {"lazy_threshold": 0.0, "compress_above": above}, 9, list(range(5, 5 + length)))
    assert all(bool(mask.all()) for mask in masks) == (length <= (9 if above == "budget" else 11))


def test_refusals():
    policy = build_policy("simlayerkv", {})
    assert "engine.regime=streaming" in (policy.refusal("streaming", False) or "")
    assert "engine.decode_evict=true" in (policy.refusal("oneshot", False, decode_evict=True) or "")
    assert policy.refusal("oneshot", False) is None
    assert "a budget above 4" in (policy.budget_refusal(4, 100) or "")
    assert policy.budget_refusal(4, 4) is None  # not evicted: nothing to refuse
    assert policy.budget_refusal(5, 100) is None
