"""``+compat=cakekv``: CAKE run as antgroup/cakekv (c4675ce) runs it keeps the release's sets token for token.

The fixture (``tests/fixtures/cakekv/cake.json``) was made by ``scripts/cakekv_fixtures.py`` in the release's own
environment (transformers 4.43): three 512-token essay prompts at two budgets, cascading as the release's LongBench
script runs it, the kept positions per layer and KV head. The paper's proportional split (kvbench's default) shares
the same total otherwise, so the same prompts keep other sets there.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from kvbench.engine.engine import Engine
from kvbench.models import load_model, model_config
from kvbench.policies import build_policy
from tests import helpers
from tests.helpers import engine, random_prompt, tiny_model, unpacked_mask

FIXTURE = Path(__file__).parent / "fixtures" / "cakekv" / "cake.json"
#: the settings +compat=cakekv gives (conf/compat/cakekv.yaml)
RELEASED = {"compress_above": "budget_and_window", "layer_budget": {"name": "cake", "rounding": "released"}}


@cache
def smollm2():
    return load_model(model_config("smollm2_135m")).model


def kept_masks(settings: dict, budget: int, ids: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """kvbench's CAKE kept positions per layer ``[Hkv, len(ids)]`` after a oneshot prefill, and its layer budgets."""
    runner = Engine(smollm2(), build_policy("cake", settings), budget, "oneshot")
    cache = runner.new_cache(len(ids))
    runner.prefill(cache, ids)
    return helpers.kept_masks(cache, len(ids)), cache.tokens_per_layer()


def release_masks(case: dict, heads: int, length: int) -> list[torch.Tensor]:
    return [unpacked_mask(packed, heads, length) for packed in case["kept_masks"]]


@pytest.mark.model
def test_compat_cakekv_keeps_the_releases_sets():
    record = json.loads(FIXTURE.read_text())
    differing = 0
    for case in record["cases"]:
        mine, budgets = kept_masks(RELEASED, case["cache_size"], case["ids"])
        theirs = release_masks(case, mine[0].shape[0], record["length"])
        assert [budget - record["window"] for budget in budgets] == case["layer_budgets"]
        for layer, (kept, released) in enumerate(zip(mine, theirs)):
            assert torch.equal(kept, released), f"budget {case['cache_size']}, layer {layer}"
        paper, _ = kept_masks({}, case["cache_size"], case["ids"])
        differing += sum(not torch.equal(kept, released) for kept, released in zip(paper, theirs))
    assert differing > 0  # the paper's rounding keeps other sets on these prompts


def test_compat_cakekv_leaves_a_prompt_within_budget_and_window_whole():
    """The release compresses only a prompt longer than the budget and the window; by default a prompt longer than
    the budget is evicted, as by every policy."""
    prompt = random_prompt(60)  # longer than the budget (56), not than the budget and the window (56 + 8)
    for settings, kept in ((RELEASED, [60, 60, 60]), ({}, None)):
        runner = engine(tiny_model(), "cake", 56, "oneshot", window=8, **settings)
        cache = runner.new_cache(len(prompt))
        runner.prefill(cache, prompt)
        sizes = cache.tokens_per_layer()
        assert sizes == kept if kept else sum(sizes) == 56 * 3  # evicted to the budget: 168 of 180
