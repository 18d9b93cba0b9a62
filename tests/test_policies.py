"""Each baseline's kept set equals a direct, loop-based implementation of its paper's definition."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.budgets import Budget
from kvbench.engine.attention import sdpa_attention
from kvbench.engine.cache import EvictionCache
from kvbench.engine.runner import score_block_size
from kvbench.errors import KVBenchError
from kvbench.policies import build_policy, parse_spec
from kvbench.policies.methods.pyramidkv import Pyramid
from kvbench.policies.stats import BLOCK_ELEMENTS, AttentionStats

Q_HEADS, KV_HEADS, DIM, TOKENS = 4, 2, 8, 40
SCALING = DIM**-0.5


def random_layer(seed: int):
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(1, Q_HEADS, TOKENS, DIM, generator=generator) * 2
    keys = torch.randn(1, KV_HEADS, TOKENS, DIM, generator=generator) * 2
    values = torch.randn(1, KV_HEADS, TOKENS, DIM, generator=generator)
    return queries, keys, values


def evict_with_cache(spec: str, params: dict, budget: int, seed: int) -> list[set[int]]:
    """Prefill one layer of T tokens through an EvictionCache and return each cache head's kept positions."""
    policy = build_policy(spec, params)
    cache = EvictionCache(policy, [budget], TOKENS, Q_HEADS, KV_HEADS)
    queries, keys, values = random_layer(seed)
    cache.begin_forward(torch.arange(TOKENS), evict=True)
    cache.update(keys, values, 0)
    cache.after_attention(0, queries, sdpa_attention(queries, keys, values, SCALING), SCALING)
    layer = cache.layers[0]
    assert layer.keys.shape[2] == budget and layer.values.shape[2] == budget
    return [set(layer.positions[0, head].tolist()) for head in range(layer.positions.shape[1])]


def attention_row(query: list[float], keys: list[list[float]], upto: int) -> list[float]:
    """softmax over keys 0..upto of q·k/√d, zero after ``upto`` (causal), by explicit loops."""
    logits = [sum(q * k for q, k in zip(query, keys[p])) * SCALING for p in range(upto + 1)]
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    total = sum(exps)
    return [e / total for e in exps] + [0.0] * (len(keys) - upto - 1)


def head_scores(queries, keys, kv_head: int, query_indices, query_heads=None) -> list[float]:
    """Σ over the query heads (default: the KV head's group) and the given queries of A_ip."""
    group = Q_HEADS // KV_HEADS
    query_heads = range(kv_head * group, (kv_head + 1) * group) if query_heads is None else query_heads
    scores = [0.0] * TOKENS
    key_rows = keys[0, kv_head].tolist()
    for q_head in query_heads:
        for i in query_indices:
            row = attention_row(queries[0, q_head, i].tolist(), key_rows, i)
            scores = [s + a for s, a in zip(scores, row)]
    return scores


def top_positions(scores: list[float], candidates: list[int], count: int) -> set[int]:
    return set(sorted(candidates, key=lambda p: scores[p], reverse=True)[:count])


def assert_top_with_ties(kept: set[int], scores: list[float], candidates: list[int], count: int, tol=1e-6):
    """``kept`` holds ``count`` candidates: every one scoring above the count-th best, the rest tied with it."""
    assert len(kept) == count and kept <= set(candidates)
    threshold = sorted((scores[p] for p in candidates), reverse=True)[count - 1]
    assert all(p in kept for p in candidates if scores[p] > threshold + tol)
    assert all(abs(scores[p] - threshold) <= tol for p in kept if scores[p] <= threshold + tol)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_h2o_matches_accumulated_attention(seed):
    budget, recent = 16, 6
    kept = evict_with_cache("h2o", {"window": recent}, budget, seed)
    queries, keys, _ = random_layer(seed)
    for head in range(KV_HEADS):
        scores = head_scores(queries, keys, head, range(TOKENS))
        window = set(range(TOKENS - recent, TOKENS))
        expected = window | top_positions(scores, list(range(TOKENS - recent)), budget - recent)
        assert kept[head] == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tova_head_mode_matches_last_query_attention(seed):
    budget = 12
    kept = evict_with_cache("tova", {"heads": "head"}, budget, seed)
    queries, keys, _ = random_layer(seed)
    for head in range(KV_HEADS):
        scores = head_scores(queries, keys, head, [TOKENS - 1])
        assert kept[head] == top_positions(scores, list(range(TOKENS)), budget)
    assert kept[0] != kept[1]  # each head keeps its own tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tova_layer_mode_keeps_the_head_averaged_top_tokens_in_every_head(seed):
    """TOVA's released code: the last query's attention averaged over all heads of the layer, one top-k,
    the same positions in every cache head."""
    budget = 12
    kept = evict_with_cache("tova", {}, budget, seed)
    queries, keys, _ = random_layer(seed)
    averaged = [sum(column) for column in zip(*(head_scores(queries, keys, h, [TOKENS - 1]) for h in range(KV_HEADS)))]
    assert all(head == top_positions(averaged, list(range(TOKENS)), budget) for head in kept)


def test_h2o_scored_over_a_window_is_snapkv_without_pooling():
    """OBCache's prefill H2O ("SnapKV's version", App. C.2.1): with ``score_window = window`` it keeps what
    SnapKV with ``pool=none`` keeps; scoring every query (H2O's own) keeps something else."""
    budget, window = 16, 6
    for seed in range(3):
        windowed = evict_with_cache("h2o", {"window": window, "score_window": window}, budget, seed)
        assert windowed == evict_with_cache("snapkv", {"window": window, "pool": "none"}, budget, seed)
    assert any(
        evict_with_cache("h2o", {"window": window}, budget, seed)
        != evict_with_cache("h2o", {"window": window, "score_window": window}, budget, seed)
        for seed in range(3)
    )


def test_sinks_are_kept_by_h2o_and_tova():
    for spec, settings in (("h2o", {"window": 4, "n_sink": 4}), ("tova", {"n_sink": 4})):
        assert all({0, 1, 2, 3} <= head for head in evict_with_cache(spec, settings, 12, seed=1))


@pytest.mark.parametrize("pool,kernel", [("avg", 5), ("max", 7), ("none", 1)])
def test_snapkv_matches_pooled_window_attention(pool, kernel):
    budget, window, seed = 18, 8, 3
    kept = evict_with_cache("snapkv", {"window": window, "pool": pool, "kernel": kernel}, budget, seed)
    queries, keys, _ = random_layer(seed)
    prefix = TOKENS - window
    for head in range(KV_HEADS):
        raw = head_scores(queries, keys, head, range(prefix, TOKENS))[:prefix]
        pooled = []
        for p in range(prefix):
            neighbours = [raw[j] if 0 <= j < prefix else 0.0 for j in range(p - kernel // 2, p + kernel // 2 + 1)]
            if pool == "avg":
                pooled.append(sum(neighbours) / kernel)  # count_include_pad, as SnapKV's avg_pool1d
            elif pool == "max":
                pooled.append(max(raw[j] for j in range(max(0, p - kernel // 2), min(prefix, p + kernel // 2 + 1))))
            else:
                pooled.append(raw[p])
        assert set(range(prefix, TOKENS)) <= kept[head]
        assert_top_with_ties(kept[head] - set(range(prefix, TOKENS)), pooled, list(range(prefix)), budget - window)


def test_sink_keeps_first_and_most_recent_tokens():
    kept = evict_with_cache("sink", {"n_sink": 4}, 10, seed=0)
    assert all(head == {0, 1, 2, 3, *range(TOKENS - 6, TOKENS)} for head in kept)


def test_gqa_repeat_layout_selects_per_query_head():
    budget = 12
    kept = evict_with_cache("tova", {"gqa": "repeat", "heads": "head"}, budget, seed=4)
    assert len(kept) == Q_HEADS
    queries, keys, _ = random_layer(4)
    for q_head in range(Q_HEADS):
        scores = head_scores(queries, keys, q_head // 2, [TOKENS - 1], query_heads=[q_head])
        assert kept[q_head] == top_positions(scores, list(range(TOKENS)), budget)


def test_gqa_mean_ranks_like_sum():
    assert evict_with_cache("h2o", {"gqa": "mean", "window": 4}, 14, 5) == evict_with_cache(
        "h2o", {"gqa": "sum", "window": 4}, 14, 5
    )


def test_pyramid_budgets_follow_pyramidkv_formula():
    budget, window, layers, beta = 128, 32, 8, 20.0
    budgets = Pyramid(beta=beta).allocate(budget, layers, window, 4000)
    free = budget - window
    top, bottom = free / beta, 2 * free - free / beta
    expected = [window + bottom - (bottom - top) * layer / (layers - 1) for layer in range(layers)]
    assert sum(budgets) == budget * layers
    assert all(abs(got - want) <= 1 for got, want in zip(budgets, expected))
    assert budgets == sorted(budgets, reverse=True)


def test_pyramid_caps_a_layer_at_the_prompt_and_shares_the_rest():
    """Near the prompt's length eq. 7's bottom layers would hold more than the prompt: each is capped at it and the
    other layers share what it cannot hold (in eq. 7's proportions), so that the total is still budget × layers."""
    assert Pyramid().allocate(59, 3, 8, 60) == [60, 60, 57]  # eq. 7 alone: [8 + 100, 8 + 51, 8 + 2]
    assert Pyramid().allocate(40, 3, 8, 60) == [60, 50, 10]  # the bottom capped, eq. 7 (32 : 1.6) below it


@pytest.mark.parametrize(
    "budget,window,layers,prompt,expected",
    [
        # KVCache-Factory PyramidKVCluster by hand: min = (B−w)//20, max = 2(B−w) − min, step (max−min)//(L−1)
        (128, 8, 30, 1800, [8 + 234 - 7 * layer for layer in range(30)]),
        (128, 32, 32, 1800, [32 + 188 - 5 * layer for layer in range(32)]),
        (128, 8, 30, 200, [128] * 30),  # prompt < 2(B−w): uniform
        (128, 8, 30, 241, [8 + 233 - 7 * layer for layer in range(30)]),  # max clamped to q_len − w
    ],
)
def test_pyramid_kvcache_factory_schedule(budget, window, layers, prompt, expected):
    assert Pyramid(schedule="kvcache_factory").allocate(budget, layers, window, prompt) == expected


@pytest.mark.parametrize(
    "spec,tokens,fraction",
    [("64", 64, None), ("2k", 2048, None), ("4096", 4096, None), ("10pct", None, 0.1), ("0.5k", 512, None)],
)
def test_budget_parsing(spec, tokens, fraction):
    budget = Budget.parse(spec)
    assert (budget.tokens, budget.fraction) == (tokens, fraction)


def test_budget_fraction_resolves_against_prompt():
    assert Budget.parse("10pct").resolve(3000) == 300


@pytest.mark.parametrize(
    "spec,name,byte_fraction,byte_count",
    [
        ("0.25x", "0.25x", 0.25, None),
        ("1x", "1x", 1.0, None),
        ("64MiB", "64MiB", None, 64 * 2**20),
        ("64mib", "64MiB", None, 64 * 2**20),
        ("0.250x", "0.25x", 0.25, None),
        ("64.0MiB", "64MiB", None, 64 * 2**20),
        ("512KiB", "512KiB", None, 2**19),
        ("1.5GiB", "1.5GiB", None, 3 * 2**29),
    ],
)
def test_byte_budgets_parse_to_their_bytes(spec, name, byte_fraction, byte_count):
    budget = Budget.parse(spec)
    assert (budget.spec, budget.byte_fraction, budget.byte_count) == (name, byte_fraction, byte_count)
    assert budget.in_bytes and budget.tokens is None and budget.fraction is None


def test_a_byte_budget_buys_the_most_tokens_within_its_bytes():
    """Of the full cache of the prompt (a fraction) or a count: the most tokens per layer and cache head whose cache,
    beside what it holds whatever the budget (``fixed_bytes``: sliding windows), holds at most those bytes — never
    below one token; without the bytes a token costs, a one-line error."""
    assert Budget.parse("0.25x").resolve(200, token_bytes=1000) == 50
    assert Budget.parse("0.1x").resolve(203, token_bytes=1000) == 20  # 20.3 tokens' bytes: 20 fit
    assert Budget.parse("0.5x").resolve(100, token_bytes=10, fixed_bytes=600) == 20  # (0.5 · 1600 − 600) / 10
    assert Budget.parse("1KiB").resolve(5000, token_bytes=100) == 10
    assert Budget.parse("1KiB").resolve(5000, token_bytes=100, fixed_bytes=1000) == 1  # the windows take it all
    with pytest.raises(KVBenchError, match=r"^budget 64MiB needs the bytes a cached token costs"):
        Budget.parse("64MiB").resolve(100)


@pytest.mark.parametrize("spec", ["0", "-5", "abc", "0pct", "150pct", "1.5", "0x", "1.5x", "64MB", "0.0001KiB"])
def test_bad_budget_is_one_line_error(spec):
    with pytest.raises(KVBenchError) as error:
        Budget.parse(spec)
    assert spec in str(error.value) and "\n" not in str(error.value)


def test_unknown_policy_names_the_choices():
    with pytest.raises(KVBenchError, match=r"unknown policy 'h3o'; valid choices: .*h2o.*snapkv"):
        parse_spec("h3o")
    with pytest.raises(KVBenchError, match="unknown policy modifier 'nope'"):
        parse_spec("h2o+nope")


def gappy_stats() -> AttentionStats:
    """A evicted-looking cache (sorted, gappy positions that differ per head) and a causal block of queries
    whose positions overlap the cache's: some queries see only part of it."""
    generator = torch.Generator().manual_seed(5)
    key_positions = torch.stack(
        [torch.randperm(60, generator=generator)[:TOKENS].sort().values for _ in range(KV_HEADS)]
    )
    return AttentionStats(
        queries=torch.randn(1, Q_HEADS, 17, DIM, generator=generator) * 2,
        keys=torch.randn(1, KV_HEADS, TOKENS, DIM, generator=generator) * 2,
        values=torch.randn(1, KV_HEADS, TOKENS, DIM, generator=generator),
        query_positions=torch.arange(43, 60),
        key_positions=key_positions[None],
        scaling=SCALING,
    )


@pytest.mark.parametrize("block_size", [1, 3, 7, 17, None])
@pytest.mark.parametrize("spec", ["h2o", "snapkv+obcache_joint"])
def test_blockwise_statistics_equal_one_masked_softmax(block_size, spec):
    """Blocks that skip unseen slots and the causal check of slots all their queries see give the same
    outputs and summed contributions as one dense masked softmax."""
    stats = gappy_stats()
    policy = build_policy(spec, {})
    keys = stats.per_query_head(stats.keys)  # [B,Hq,T,D]
    logits = torch.einsum("bhqd,bhtd->bhqt", stats.queries, keys) * SCALING
    future = stats.per_query_head(stats.key_positions)[:, :, None, :] > stats.query_positions[:, None]
    weights = logits.masked_fill(future, float("-inf")).softmax(dim=-1)  # [B,Hq,W,T]
    outputs = torch.cat([block.outputs for block in stats.blocks(block_size)], dim=2)
    torch.testing.assert_close(outputs, weights @ stats.per_query_head(stats.values), rtol=1e-5, atol=1e-5)
    dense = policy.contributions(stats).sum(dim=2).view(1, KV_HEADS, -1, TOKENS).sum(dim=2)
    torch.testing.assert_close(policy.summed_contributions(stats, block_size), dense, rtol=1e-5, atol=1e-5)


def test_accelerator_blocks_are_sized_by_memory():
    stats = gappy_stats()
    assert stats.block_queries() == 128
    on_meta = AttentionStats(
        *(tensor.to("meta") for tensor in (stats.queries, stats.keys, stats.values)),
        stats.query_positions,
        stats.key_positions,
        SCALING,
    )
    assert on_meta.block_queries() == BLOCK_ELEMENTS // (Q_HEADS * TOKENS)
    assert score_block_size("auto") is None and score_block_size(64) == 64
    with pytest.raises(KVBenchError, match="^engine.score_block=0: must be auto or a query count ≥ 1$"):
        score_block_size(0)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_snapkv_max_pool_ties_break_as_the_reference_topk(seed):
    """Max pooling copies one value onto up to ``kernel`` neighbours; kvbench picks among such exact ties as
    KVCache-Factory does: ``topk(capacity − window)`` over the pooled prefix alone, then the window."""
    budget, window, kernel = 18, 8, 7
    kept = evict_with_cache(
        "snapkv", {"window": window, "pool": "max", "kernel": kernel, "gqa": "repeat"}, budget, seed
    )
    queries, keys, _ = random_layer(seed)
    prefix = TOKENS - window
    for q_head in range(Q_HEADS):
        raw = head_scores(queries, keys, q_head // 2, range(prefix, TOKENS), query_heads=[q_head])[:prefix]
        pooled = torch.tensor([max(raw[max(0, p - kernel // 2) : p + kernel // 2 + 1]) for p in range(prefix)])
        assert len(set(pooled.tolist())) < prefix  # there are ties to break
        reference = set(pooled.topk(budget - window).indices.tolist()) | set(range(prefix, TOKENS))
        assert kept[q_head] == reference


def test_non_causal_h2o_is_kvcache_factory_before_its_causal_fix():
    """``causal=false``: the score of KVCache-Factory's H2O before 9f9aa2e, whose mask covered only the last
    ``window`` × ``window`` block: queries before the window weigh every key, future ones included."""
    budget, recent, seed = 16, 6, 2
    kept = evict_with_cache("h2o", {"window": recent, "causal": False}, budget, seed)
    queries, keys, _ = random_layer(seed)
    rows = [*([TOKENS - 1] * (TOKENS - recent)), *range(TOKENS - recent, TOKENS)]  # the position each query sees up to
    for head in range(KV_HEADS):
        scores = [0.0] * TOKENS
        for q_head in range(head * 2, head * 2 + 2):
            for i, upto in enumerate(rows):
                row = attention_row(queries[0, q_head, i].tolist(), keys[0, head].tolist(), upto)
                scores = [s + a for s, a in zip(scores, row)]
        expected = set(range(TOKENS - recent, TOKENS)) | top_positions(
            scores, list(range(TOKENS - recent)), budget - recent
        )
        assert kept[head] == expected
    assert kept != evict_with_cache("h2o", {"window": recent}, budget, seed)
