"""Budgets in bytes (``budget=0.25x``, ``budget=64MiB``): each cache spends them as its tokens cost — the policy's
head layout, the model's sliding layers — and holds at most those bytes after the prompt (the records' own bytes)."""

from __future__ import annotations

import json

import pytest

from kvbench.cli import main
from kvbench.engine import Engine
from kvbench.policies import build_policy
from tests.helpers import TOKENIZER, random_prompt, tiny_model

LAYERS, KV_HEADS, QUERY_HEADS, HEAD_DIM, FLOAT32 = 3, 2, 4, 16, 4  # tiny_model's


def prefilled(model, spec: str, budget: str, prompt_len: int, **params):
    """The sizes of a 1-token generation of a ``prompt_len`` prompt: after the prompt, and the full cache's bytes."""
    engine = Engine(model, build_policy(spec, params), budget, tokenizer=TOKENIZER)
    return engine.generate(random_prompt(prompt_len), 1).kv


@pytest.mark.parametrize("spec", ["snapkv", "pyramidkv", "snapkv+adakv"])
def test_a_fraction_of_the_full_caches_bytes_holds_at_most_that_fraction(spec):
    """``0.25x`` of a 200-token prompt's full cache: 50 tokens a layer and cache head on average (a pyramid's
    layers and AdaKV's heads share them), the bytes held after the prompt a quarter of the prompt's full cache."""
    kv = prefilled(tiny_model(), spec, "0.25x", 200)
    prompt_bytes = 200 * LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32
    assert kv.after_prefill_bytes <= 0.25 * prompt_bytes
    assert kv.after_prefill_bytes == 50 * LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32


def test_a_byte_count_buys_the_tokens_it_holds_in_the_policys_head_layout():
    """``budget=NKiB``: the most tokens whose cache fits, in KV heads (SnapKV) or repeated to the query heads
    (``gqa=repeat``: a token costs twice as much, half the tokens)."""
    token = LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32  # 768 bytes a token across the layers
    budget = f"{(37 * token + token // 2) / 1024:g}KiB"  # 37.5 tokens' bytes
    model = tiny_model()
    grouped = prefilled(model, "snapkv", budget, 150, window=8)
    assert grouped.after_prefill_tokens_per_layer == [37] * LAYERS and grouped.after_prefill_bytes == 37 * token
    repeated = prefilled(model, "snapkv", budget, 150, window=8, gqa="repeat")
    assert repeated.after_prefill_tokens_per_layer == [18] * LAYERS  # 37.5 / 2 tokens of twice the heads
    assert repeated.after_prefill_bytes == 18 * 2 * token <= 37.5 * token


def test_sliding_layers_hold_their_windows_and_the_budget_buys_the_rest():
    """Gemma 3's sliding layers hold their window whatever the budget: a fraction of the full cache's bytes (the
    windows as the model holds them) buys the global layers' tokens from what the windows leave."""
    model = tiny_model("gemma3", layers=6)
    kv = prefilled(model, "snapkv", "0.5x", 300)
    full = prefilled(model, "full", "4k", 300)
    assert kv.after_prefill_bytes <= 0.5 * full.after_prefill_bytes
    windows = [tokens for tokens, big in zip(full.after_prefill_tokens_per_layer, [300] * 6) if tokens < big]
    assert windows and all(tokens in windows for tokens in kv.after_prefill_tokens_per_layer if tokens in windows)
    assert kv.after_prefill_bytes > 0.5 * full.after_prefill_bytes - 2 * full.after_prefill_bytes / (300 * 6)


def test_a_run_with_a_byte_budget_is_named_by_it_and_records_its_bytes(tmp_path):
    out = tmp_path / "run"
    ruler = ["model=tiny_llama", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=640"]
    main(["run", *ruler, "task.num_samples=1", "policy=snapkv", "budget=0.25X", f"output_dir={out}"])
    metrics = json.loads((out / "metrics.json").read_text())
    record = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])
    assert metrics["budget"] == "0.25x"
    kv, prompt = record["kv"], record["prompt_tokens"]
    assert kv["after_prefill_tokens_per_layer"] == [prompt // 4] * LAYERS  # 457 tokens: 114 each
    assert kv["after_prefill_bytes"] <= 0.25 * prompt * LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32


def test_tables_plots_and_paper_cells_take_byte_budgets_by_their_own_kind():
    from kvbench.results.compare import budget_fits
    from kvbench.results.plots import budget_value
    from kvbench.results.table import budget_key

    specs = ["64MiB", "0.5x", "10pct", "2k", "0.25x", "128", "1GiB"]
    assert sorted(specs, key=budget_key) == ["128", "2k", "10pct", "0.25x", "0.5x", "64MiB", "1GiB"]
    assert budget_value("0.25x") == ("KV budget (% of the full cache's bytes)", 25.0)
    assert budget_value("64MiB") == ("KV budget (MiB)", 64.0)
    assert budget_fits("2k", "snapkv", "2048") and budget_fits("0.25x", "snapkv", "0.25x")
    assert budget_fits("1MiB", "snapkv", "1024KiB") and not budget_fits("0.25x", "snapkv", "25pct")
