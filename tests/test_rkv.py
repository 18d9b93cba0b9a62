"""R-KV (kvbench/policies/methods/rkv.py) against a brute-force reading of its equations, head by head and slot by
slot (R-KV §3; ``R1KV.update_kv`` and ``cal_similarity`` at Zefan-Cai/R-KV d15c976): the scores and the kept slots;
and a streaming run evicting while it decodes, its cache at the budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvbench.policies import build_policy
from kvbench.policies.context import ScoreContext
from kvbench.policies.stats import AttentionStats
from tests.helpers import refused


def brute_force(queries, keys, window, kernel, mix, threshold):
    """``[B,Hc,T-window]`` scores by loops: queries ``[B,Hq,W,D]`` (the last W), keys ``[B,Hc,T,D]``."""
    batch, q_heads, queries_count, dim = queries.shape
    heads, tokens = keys.shape[1], keys.shape[2]
    group, before = q_heads // heads, tokens - window
    scores = torch.zeros(batch, heads, before)
    for b in range(batch):
        for h in range(heads):
            importance = torch.zeros(before)
            for i in range(queries_count):  # logits max over the group, softmax over the slots before the window
                logits = torch.tensor(
                    [
                        max(float(queries[b, h * group + g, i] @ keys[b, h, p]) for g in range(group))
                        for p in range(before)
                    ]
                ) / math.sqrt(dim)
                importance += torch.softmax(logits, dim=0) / queries_count
            pooled = torch.tensor(
                [max(importance[max(0, p - kernel // 2) : p + kernel // 2 + 1]) for p in range(before)]
            )
            unit = [keys[b, h, p] / (keys[b, h, p].norm() + 1e-8) for p in range(tokens)]
            similarity = torch.tensor(
                [[0.0 if p == q else float(unit[p] @ unit[q]) for q in range(tokens)] for p in range(tokens)]
            )
            for p in range(tokens):  # the last repeat of each key (or slot 0 where it has none) left out
                repeats = [q for q in range(tokens) if similarity[p, q] > threshold]
                similarity[p, repeats[-1] if repeats else 0] = 0.0
            redundancy = torch.softmax(similarity.mean(dim=0), dim=0)[:before]
            scores[b, h] = mix * pooled - (1 - mix) * redundancy
    return scores


@pytest.mark.parametrize(("group", "tokens", "window", "kernel"), [(1, 20, 4, 7), (3, 33, 8, 3), (2, 9, 8, 7)])
def test_rkv_scores_are_its_equations(group, tokens, window, kernel):
    torch.manual_seed(0)
    batch, heads, dim = 1, 2, 8
    keys = torch.randn(batch, heads, tokens, dim)
    keys[:, :, 5] = keys[:, :, 2] * 2 + 0.01  # a repeat: cosine similarity near 1
    queries = torch.randn(batch, heads * group, window, dim)
    positions = torch.arange(tokens)
    stats = AttentionStats(queries, keys, keys, positions[-window:], positions.expand(batch, heads, tokens), dim**-0.5)
    policy = build_policy("rkv", {"window": window, "kernel": kernel, "threshold": 0.5})
    context = ScoreContext(keys, keys, positions.expand(batch, heads, tokens), None, window, window=stats)
    scores = policy.score(context)
    expected = brute_force(queries, keys, window, kernel, policy.mix_lambda, 0.5)
    torch.testing.assert_close(scores[..., : tokens - window], expected, rtol=1e-5, atol=1e-7)
    assert torch.isinf(scores[..., tokens - window :]).all()  # the window kept
    kept = max(1, tokens - window - 2)
    assert torch.equal(
        scores[..., : tokens - window].topk(kept).indices.sort().values, expected.topk(kept).indices.sort().values
    )


def test_a_streaming_run_keeps_the_budget_while_it_decodes():
    from kvbench.engine import Engine
    from tests.helpers import TOKENIZER, random_prompt, tiny_model

    runner = Engine(tiny_model(), build_policy("rkv", {}), 24, regime="streaming", tokenizer=TOKENIZER)
    output = runner.generate(random_prompt(40), 16)
    assert len(output.token_ids) == 16 and max(output.kv.peak_tokens_per_layer) <= 24 + 1


@pytest.mark.parametrize("interval", [1, 4])
def test_a_decode_interval_lets_the_cache_grow_by_it_then_evicts_to_the_budget(interval, monkeypatch):
    """``engine.decode_interval``: while decoding the cache evicts after every ``interval``-th token (R-KV's buffer),
    holding between the budget and the budget plus the interval less one after each step; rows decoded together
    as each alone."""
    from kvbench.engine import Engine
    from kvbench.engine.cache import EvictionCache
    from kvbench.engine.rows import decode_rows
    from tests.helpers import TOKENIZER, random_prompt, tiny_model

    held: list[int] = []
    begin = EvictionCache.begin_forward

    def watched(self, positions, evict, decoding=False):  # the cache's size before each decoding forward
        if decoding:
            held.append(max(self.tokens_per_layer()))
        begin(self, positions, evict, decoding)

    monkeypatch.setattr(EvictionCache, "begin_forward", watched)
    model, budget = tiny_model(), 24
    runner = Engine(
        model, build_policy("rkv", {}), budget, regime="streaming", decode_interval=interval, tokenizer=TOKENIZER
    )
    prompts = [random_prompt(40, seed=seed) for seed in (1, 2, 3)]
    alone = [runner.generate(prompt, 13).token_ids for prompt in prompts]
    assert max(held) == budget + interval - 1 and min(held) == budget  # grows by the interval, back to the budget
    together = decode_rows([runner.prefilled_row(prompt, 13) for prompt in prompts], 3)
    assert [output.token_ids for output in together] == alone
    curve = together[0].kv_curve  # the bytes after each decode step: at the budget after each eviction
    entry = min(curve) // budget
    assert len(curve) == 12 and min(curve) == budget * entry and max(curve) == (budget + interval - 1) * entry


def test_a_record_keeps_an_evicting_caches_bytes_over_the_generation():
    from kvbench.run.records import CURVE_POINTS, kv_over_generation

    curve = list(range(100, 200))  # 100 steps: every 4th kept, the last always
    kept = kv_over_generation(curve)
    assert kept["peak_bytes"] == 199 and kept["mean_bytes"] == 149.5 and kept["stride"] == 4
    assert kept["curve"][-1] == 199 and kept["curve"][:2] == [103, 107] and len(kept["curve"]) <= CURVE_POINTS
    assert kv_over_generation([5, 6])["curve"] == [5, 6]


def test_a_decode_interval_without_decode_eviction_is_one_line(capsys, tmp_path):

    run = ["run", "model=tiny_llama", "policy=h2o", "engine.decode_interval=8", f"output_dir={tmp_path / 'run'}"]
    error = refused(capsys, run, tmp_path / "run")
    assert "engine.decode_interval=8 spaces the evictions while decoding, and this run does not evict" in error


FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "rkv" / "rkv.pt")


@pytest.mark.parametrize(
    "case", FIXTURE["cases"], ids=lambda c: f"g{c['group']}-T{c['tokens']}-b{c['budget']}-w{c['window']}"
)
def test_rkv_keeps_the_released_codes_slots(case):
    """Against ``R1KV.update_kv`` at Zefan-Cai/R-KV d15c976 (tests/fixtures/rkv, made by scripts/rkv_fixtures.py):
    the slots each KV head keeps — the top ``budget − window`` of the final score before the window, then the window —
    equal on random queries and keys with planted near-repeats, GQA groups of 1–4, a cache at the budget."""
    from kvbench.engine.selection import top_slots

    queries, keys, window = case["queries"], case["keys"], case["window"]
    batch, heads, tokens, dim = keys.shape
    positions = torch.arange(tokens)
    stats = AttentionStats(queries, keys, keys, positions[-window:], positions.expand(batch, heads, tokens), dim**-0.5)
    policy = build_policy("rkv", {"window": window, "kernel": case["kernel"]})
    context = ScoreContext(keys, keys, positions.expand(batch, heads, tokens), None, window, window=stats)
    budget = min(case["budget"], tokens)
    kept = top_slots(policy.score(context), budget, window, 0) if budget < tokens else positions.expand(1, heads, -1)
    assert torch.equal(kept[0], case["kept"])
