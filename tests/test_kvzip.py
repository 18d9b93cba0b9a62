"""KVzip: the reconstruction statistic against a brute force, the layers' shares by the scores, kvpress's scores and
shares (``tests/fixtures/kvpress/kvzip.json``, by ``scripts/kvpress_fixtures.py``), one reconstruction per grid, and
the one-line refusals."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvbench.cli import main as kvbench_main
from kvbench.engine.cache import EvictionCache
from kvbench.engine.reconstruction import RepeatPrompt
from kvbench.engine.shared import generate_shared
from kvbench.errors import KVBenchError
from kvbench.policies.layer_budget import conserve_total
from kvbench.policies.methods.kvzip import kept_counts
from tests.helpers import (
    TOKENIZER,
    engine,
    kept_masks,
    masked_forward,
    random_prompt,
    refused,
    tiny_model,
    unpacked_mask,
)

FIXTURE = Path(__file__).parent / "fixtures" / "kvpress" / "kvzip.json"
LAYERS = 3


@pytest.fixture
def received(monkeypatch) -> list[list[torch.Tensor]]:
    """Each reconstructed cache's statistic ``[B,Hc,T]`` per layer, as it is evicted by it."""
    seen: list[list[torch.Tensor]] = []
    evict = EvictionCache.evict_reconstructed

    def recording(cache, statistic):
        seen.append([layer.clone() for layer in statistic])
        evict(cache, statistic)

    monkeypatch.setattr(EvictionCache, "evict_reconstructed", recording)
    return seen


def queries_and_keys(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's post-RoPE queries ``[Hq,N,D]`` and keys ``[Hkv,N,D]`` of one plain forward over ``tokens``."""
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_):
        captured.append((query[0].double(), key[0].double()))
        group = query.shape[1] // key.shape[1]
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), is_causal=True
        )
        return output.transpose(1, 2), None

    AttentionInterface.register("kvbench_test_capture", attention)
    AttentionMaskInterface.register("kvbench_test_capture", lambda *args, **kwargs: None)
    model.set_attn_implementation("kvbench_test_capture")
    with torch.no_grad():
        model(torch.tensor([tokens]))
    return captured


def brute_force(model, context: list[int], chunk_size: int, sinks: int) -> list[torch.Tensor]:
    """KVzip eq. 2 in float64, query by query: each reconstruction forward as one plain forward over the context and
    its tokens; a repeating query attends to the first ``sinks`` slots, the chunk and the forward's tokens up to its
    own; a chunk slot scores the most any query of its KV group pays it. ``[Hkv,T]`` per layer."""
    scores = [torch.zeros(2, len(context), dtype=torch.float64) for _ in range(LAYERS)]
    for chunk, tokens in RepeatPrompt.of(TOKENIZER).forwards(context, chunk_size):
        captured = queries_and_keys(tiny_model("llama", layers=LAYERS), context + tokens)
        for layer, (queries, keys) in enumerate(captured):
            dim, group = queries.shape[-1], queries.shape[0] // keys.shape[0]
            for head in range(queries.shape[0]):
                for index in range(len(tokens)):
                    query = queries[head, len(context) + index]
                    seen = [*range(min(sinks, chunk.start)), *range(chunk.start, chunk.stop)]
                    seen += range(len(context), len(context) + index + 1)
                    weights = torch.softmax(keys[head // group, seen] @ query / dim**0.5, dim=0)
                    paid = weights[min(sinks, chunk.start) : min(sinks, chunk.start) + chunk.stop - chunk.start]
                    row = scores[layer][head // group]
                    row[chunk] = torch.maximum(row[chunk], paid)
    return scores


def test_the_reconstruction_statistic_is_kvzip_eq2(received):
    """Three chunks (one shorter) of a 100-token context, with sinks: the statistic each layer is evicted by equals the
    brute force; each layer then keeps, per head, its sinks and the top of the statistic (its share of the budget)."""
    model, context = tiny_model("llama", layers=LAYERS), random_prompt(100)
    runner = engine(model, "kvzip", 30, chunk_size=40)
    cache = runner.new_cache(len(context), context=True)
    runner.prefill(cache, context)
    expected = brute_force(model, context, 40, 4)
    for layer, statistic in enumerate(received[0]):
        torch.testing.assert_close(statistic[0].double(), expected[layer], rtol=1e-5, atol=1e-6)
    for layer, (positions, budget) in enumerate(zip(cache.kept_positions(), cache.layer_budgets)):
        ranking = received[0][layer][0].clone()
        ranking[:, :4] = torch.inf
        assert torch.equal(positions[0], ranking.topk(budget, dim=-1).indices.sort(dim=-1).values)


def test_layers_share_the_budget_by_the_scores_or_keep_their_own_layerwise(received):
    """Unless ``layerwise``, each layer keeps its count of the top ``budget × layers × heads`` slots of every layer
    and head together (sorted by hand here), over its heads, rounded with the total kept; ``layerwise``: the budget."""
    model, context = tiny_model("llama", layers=LAYERS), random_prompt(120)
    shares = {}
    for layerwise in (False, True):
        runner = engine(model, "kvzip", 32, chunk_size=64, layerwise=layerwise)
        cache = runner.new_cache(len(context), context=True)
        runner.prefill(cache, context)
        shares[layerwise] = cache.tokens_per_layer()
    assert shares[True] == [32] * LAYERS
    entries = sorted(
        (
            (float("inf") if slot < 4 else float(score), layer)
            for layer, statistic in enumerate(received[0])
            for row in statistic[0]
            for slot, score in enumerate(row)
        ),
        reverse=True,
    )[: 32 * LAYERS * 2]
    counts = [sum(1 for _, owner in entries if owner == layer) for layer in range(LAYERS)]
    assert kept_counts(received[0], 32 * LAYERS * 2, 4) == counts
    assert shares[False] == conserve_total(counts, 32 * LAYERS, caps=[120] * LAYERS) != shares[True]


@pytest.mark.parametrize("layerwise", [False, True])
def test_headwise_kvzip_keeps_each_heads_own_share_of_the_top_slots(received, layerwise):
    """``headwise``: each cache head keeps exactly its slots among the top ``budget × heads`` of its layer
    (``layerwise``) or ``budget × layers × heads`` of every layer (sorted by hand here), its sinks first; the layer
    holds a length per head, and its question attends only to them."""
    model, context = tiny_model("llama", layers=LAYERS), random_prompt(120)
    runner = engine(model, "kvzip", 32, chunk_size=64, layerwise=layerwise, headwise=True)
    cache = runner.new_cache(len(context), context=True)
    runner.prefill(cache, context)
    entries = [
        (float("inf") if slot < 4 else float(score), layer, head, slot)
        for layer, statistic in enumerate(received[0])
        for head, row in enumerate(statistic[0])
        for slot, score in enumerate(row)
    ]
    groups = [[entry for entry in entries if entry[1] == layer] for layer in range(LAYERS)] if layerwise else [entries]
    expected = torch.zeros(LAYERS, 2, len(context), dtype=torch.bool)
    for group in groups:
        for _, layer, head, slot in sorted(group, reverse=True)[: 32 * 2 * len(group) // (2 * 120)]:
            expected[layer, head, slot] = True
    kept = kept_masks(cache, len(context))
    assert torch.equal(torch.stack(kept), expected)
    assert any(layer.headwise is not None and len(set(layer.headwise.lengths.tolist())) > 1 for layer in cache.layers)
    question = random_prompt(5, seed=3)
    logits = runner.step(cache, question, len(context), evict=False, all_logits=True)[0]
    masked = masked_forward(tiny_model("llama", layers=LAYERS), context + question, kept, len(context))
    torch.testing.assert_close(logits, masked, rtol=1e-4, atol=1e-4)


def test_one_reconstruction_serves_every_budget_of_a_grid(monkeypatch):
    """A grid of budgets (and ``layerwise``) of one context: one reconstruction (its forwards counted), each variant
    given what it gets alone (the registry's tests check it), its time shared as ``scoring_seconds``."""
    model, prompt = tiny_model("llama", layers=LAYERS), random_prompt(160)
    runners = [engine(model, "kvzip", budget, chunk_size=64) for budget in (24, 40, 64)]
    runners.append(engine(model, "kvzip", 40, chunk_size=64, layerwise=True))
    forwards = []
    reconstruct = EvictionCache.reconstruct
    monkeypatch.setattr(
        EvictionCache, "reconstruct", lambda cache, chunk: (forwards.append(chunk), reconstruct(cache, chunk))
    )
    outputs = generate_shared(runners, prompt, 4, question_start=140)
    assert len([chunk for chunk in forwards if chunk is not None]) == 3  # 140 context tokens in chunks of 64
    assert all(0 < output.scoring_seconds <= output.prefill_seconds for output in outputs)
    assert len({tuple(output.kv.after_prefill_tokens_per_layer) for output in outputs}) == 4


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], "policy kvzip reconstructs a context before its question: it needs task.query_mode=agnostic"),
        (
            ["task.query_mode=agnostic", "engine.regime=chunked"],
            "policy kvzip reconstructs a whole prefilled context: engine.regime=oneshot, not chunked",
        ),
        (
            ["task.query_mode=agnostic", "policy.layer_budget=pyramid"],
            "policy kvzip shares the budget across layers by its scores: policy.layer_budget=pyramid needs "
            "policy.layerwise=true and a static layer budget",
        ),
    ],
)
def test_kvzip_outside_its_definition_is_one_line(tmp_path, capsys, overrides, message):
    run = ["run", "model=tiny_llama", "policy=kvzip", *overrides, f"output_dir={tmp_path / 'run'}"]
    assert refused(capsys, run, tmp_path / "run") == f"kvbench: error: {message}\n"
    with pytest.raises(KVBenchError, match="needs task.query_mode=agnostic"):
        engine(tiny_model(), "kvzip", 16).generate(random_prompt(40), 2)


@pytest.mark.model
def test_kvzip_scores_and_shares_equal_kvpress(received):
    """kvpress's ``KVzipPress`` on SmolLM2 float32 (three 512-token contexts, the chat template's user prefix first,
    chunks of 200): kvbench's reconstruction statistic equals its scores within float32 rounding on every layer and
    KV head, and the top 128 slots per layer and head on average fall in each layer as in kvpress (KVzipPress is
    head-wise: its kept sets are [headwise]'s; kvbench keeps each layer's count over its heads, rounded)."""
    if not FIXTURE.exists():
        pytest.skip("no kvpress fixture")
    from kvbench.engine.engine import Engine
    from kvbench.models import load_model, model_config
    from kvbench.policies import build_policy

    record = json.loads(FIXTURE.read_text())
    loaded = load_model(model_config("smollm2_135m"))
    for number, prompt in enumerate(record["prompts"]):
        ids = prompt["ids"]
        policy = build_policy("kvzip", {"chunk_size": record["chunk_size"]})
        runner = Engine(loaded.model, policy, record["kept"], tokenizer=loaded.tokenizer)
        assert len(runner.repeat_prompt().prefix) == prompt["prefix"]
        cache = runner.new_cache(len(ids), context=True)
        runner.prefill(cache, ids)
        ours = torch.stack([layer[0] for layer in received[number]])  # [L,Hkv,T]
        if "scores" in prompt:  # the first prompt's
            theirs = np.frombuffer(base64.b64decode(prompt["scores"]), dtype=np.float32).reshape(ours.shape)
            # within float32 rounding: another CPU's matrix kernels round the last bits (1.8e-5 relative seen)
            torch.testing.assert_close(ours, torch.from_numpy(theirs.copy()), rtol=1e-4, atol=1e-6)
        layers, heads = ours.shape[:2]
        assert kept_counts(received[number], record["kept"] * layers * heads, 4) == prompt["kept_per_layer"]
        total = record["kept"] * layers
        assert cache.layer_budgets == conserve_total(prompt["kept_per_layer"], total, caps=[len(ids)] * layers)


@pytest.mark.model
def test_headwise_kvzip_keeps_kvpress_sets():
    """``headwise`` (KVzip's and kvpress's own form): on every layer and KV head the slots kept are exactly those
    ``KVzipPress`` leaves unmasked, the same three contexts."""
    if not FIXTURE.exists():
        pytest.skip("no kvpress fixture")
    from kvbench.engine.engine import Engine
    from kvbench.models import load_model, model_config
    from kvbench.policies import build_policy

    record = json.loads(FIXTURE.read_text())
    loaded = load_model(model_config("smollm2_135m"))
    for prompt in record["prompts"]:
        ids = prompt["ids"]
        policy = build_policy("kvzip", {"chunk_size": record["chunk_size"], "headwise": True})
        runner = Engine(loaded.model, policy, record["kept"], tokenizer=loaded.tokenizer)
        cache = runner.new_cache(len(ids), context=True)
        runner.prefill(cache, ids)
        for layer, (kept, packed) in enumerate(zip(kept_masks(cache, len(ids)), prompt["kept_masks"])):
            assert torch.equal(kept, unpacked_mask(packed, kept.shape[0], len(ids))), f"layer {layer}"


def test_headwise_kvzip_has_cells_of_its_own(tmp_path):
    """``policy.headwise=true`` makes another method: its runs carry the label ``kvzip[headwise]``, by which the
    leaderboard gives them their own cells beside KVzip's per layer, at the same budget."""
    from kvbench.finished import load_runs
    from kvbench.results.leaderboard import leaderboard_tables
    from tests.test_plan import TINY

    for name, settings in (("layer", []), ("head", ["policy.headwise=true"])):
        args = [*TINY, "policy=kvzip", "budget=64", "task.query_mode=agnostic", *settings]
        kvbench_main(["run", *args, f"output_dir={tmp_path / name}"])
    runs = load_runs([tmp_path])
    assert sorted(run.metrics["label"] for run in runs) == ["kvzip", "kvzip[headwise]"]
    cells = leaderboard_tables(runs)["leaderboard_cells"]
    assert sorted(cells["policy"]) == ["kvzip", "kvzip[headwise]"] and set(cells["n"]) == {2}
