"""Head-wise budgets: AdaKV's selection against a brute force, a cache holding a length per head that attends exactly
as the full cache masked to each head's kept entries (the question read after a compressed context included), its
memory the entries kept, and the one-line refusals where it is not defined."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from kvbench.bench.measure import Operators
from kvbench.cli import main as kvbench_main
from kvbench.engine.cascade import CascadeStages
from kvbench.engine.shared import Prompt, prefill_shared
from kvbench.policies.methods.adakv import AdaKV
from tests.helpers import engine, kept_masks, masked_forward, random_prompt, refused, tiny_model

LAYERS = 3


def brute_force_adakv(scores: torch.Tensor, budget: int, recent: int, alpha: float) -> torch.Tensor:
    """AdaKV Alg. 1 slot by slot: each head keeps its last ``recent`` slots and its ``int(alpha·budget) − recent`` best,
    then the layer's best remaining slots of any head up to ``budget × heads``: the kept mask ``[Hc,T]``."""
    heads, tokens = scores.shape
    kept = torch.zeros(heads, tokens, dtype=torch.bool)
    kept[:, tokens - recent :] = True
    safe = max(max(1, int(alpha * budget)) - recent, 0)
    for head in range(heads):
        ranked = sorted(range(tokens - recent), key=lambda slot: -float(scores[head, slot]))
        kept[head, ranked[:safe]] = True
    rest = sorted(
        ((float(scores[h, t]), h, t) for h in range(heads) for t in range(tokens - recent) if not kept[h, t]),
        reverse=True,
    )
    for _, head, slot in rest[: heads * budget - int(kept.sum())]:
        kept[head, slot] = True
    return kept


@pytest.mark.parametrize("alpha", [0.2, 0.5, 1.0])
def test_adakv_keeps_the_layers_best_slots_over_its_heads_with_the_safeguard(alpha):
    scores: list[tuple[torch.Tensor, int]] = []

    @contextmanager
    def recording(layer_idx, budget, ranking, layer):  # EvictionCache.watch
        scores.append((ranking[0].clone(), budget))
        yield

    runner = engine(tiny_model(layers=LAYERS), "snapkv+adakv", 24, window=4, alpha_safeguard=alpha)
    prompt = random_prompt(80)
    cache = runner.new_cache(len(prompt))
    cache.watch = recording
    runner.prefill(cache, prompt)
    lengths = set()
    for (ranking, budget), kept in zip(scores, kept_masks(cache, len(prompt))):
        assert torch.equal(kept, brute_force_adakv(ranking, budget, 4, alpha))
        lengths |= set(kept.sum(dim=-1).tolist())
    assert (len(lengths) > 1) == (alpha < 1.0)  # the heads' lengths differ unless the safeguard is the whole budget


@pytest.mark.parametrize(
    "spec,params",
    [
        ("cake+adakv", {"window": 4}),
        ("snapkv+adakv", {"window": 4, "layer_budget": {"name": "vabs", "alpha": 0.5, "beta": 0.4}}),
    ],
)
def test_a_cascading_layer_budget_shares_each_layers_final_total_across_its_heads(monkeypatch, spec, params):
    """CAKE's cascade shrinks the layers again as it goes; each head-wise layer ends as AdaKV sharing its final budget
    from the start would keep (the kept sets are nested in the budget), by the ranking of its own stage; the budgets are
    the cascade's, CAKE's the same as the per-layer cache's (its preference reads no evicted set)."""
    rankings: dict[int, torch.Tensor] = {}
    rank = CascadeStages.rank

    def recording(stages, layer_idx, budget, scaling):
        ranking = rank(stages, layer_idx, budget, scaling)
        rankings[layer_idx] = ranking[0].clone()
        return ranking

    monkeypatch.setattr(CascadeStages, "rank", recording)
    prompt = random_prompt(90)
    runner = engine(tiny_model(layers=4), spec, 24, **params)
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    budgets = cache.layer_budgets
    assert len(set(budgets)) > 1 and sum(budgets) == 4 * 24
    for layer, (kept, budget) in enumerate(zip(kept_masks(cache, len(prompt)), budgets)):
        assert torch.equal(kept, brute_force_adakv(rankings[layer], budget, 4, 0.2))
    if spec == "cake+adakv":
        per_layer = engine(tiny_model(layers=4), "cake", 24, **params)
        dense = per_layer.new_cache(len(prompt))
        per_layer.prefill(dense, prompt)
        assert dense.layer_budgets == budgets


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "spec,params",
    [
        ("snapkv+adakv", {"window": 4}),
        ("knorm+adakv", {}),
        ("pyramidkv+adakv", {"window": 4}),
        ("cake+adakv", {"window": 4}),
    ],
)
def test_a_length_per_head_attends_as_the_full_cache_masked_to_each_heads_entries(spec, params, backend):
    """A compressed context, then a question read in one forward (causal among its tokens) and two decoded tokens:
    every logit equals the masked full forward's."""
    context, question = random_prompt(70), random_prompt(6, seed=5)
    runner = engine(tiny_model(layers=LAYERS), spec, 24, **params)
    runner.attn_backend = backend
    cache = runner.new_cache(len(context), context=True)
    runner.prefill(cache, context)
    kept = kept_masks(cache, len(context))
    assert len({int(count) for mask in kept for count in mask.sum(dim=-1)}) > 1
    logits = [runner.step(cache, question, len(context), evict=False, all_logits=True)[0]]
    answer = [int(logits[0][-1].argmax())]
    for step in range(2):
        logits.append(runner.step(cache, answer[-1:], len(context) + len(question) + step, evict=False)[0])
        answer.append(int(logits[-1][-1].argmax()))
    expected = masked_forward(tiny_model(layers=LAYERS), context + question + answer[:2], kept, len(context))
    torch.testing.assert_close(torch.cat(logits), expected, rtol=1e-4, atol=1e-4)
    assert [[int(count) for count in mask.sum(dim=-1)] for mask in kept] == [
        [len(head) - len(question) - 2 for head in layer] for layer in cache.kept_by_head()
    ]


def test_a_length_per_head_holds_the_entries_kept():
    """The layer's bytes are its kept entries' (budget × heads), as the same scorer's per layer, not the longest head
    × heads; the reports count tokens per head on average."""
    prompt = random_prompt(120)
    sizes = []
    for spec in ("snapkv", "snapkv+adakv"):
        runner = engine(tiny_model(layers=LAYERS), spec, 32, window=4)
        runner.record_kept = True
        output = runner.generate(prompt, 3)
        sizes.append((output.kv.peak_bytes, output.kv.after_prefill_tokens_per_layer))
        assert output.kept is not None
        kept = output.kept
    assert sizes[0] == sizes[1]
    assert all(sum(map(len, layer)) == 2 * 32 for layer in kept)
    assert any(len({len(head) for head in layer}) > 1 for layer in kept)
    runner = engine(tiny_model(layers=LAYERS), "snapkv+adakv", 32, window=4)
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    for layer in cache.eviction_layers:
        assert layer.headwise is not None and layer.held_bytes() == 2 * 2 * 32 * 16 * 4
    assert (
        max(layer.headwise.longest for layer in cache.eviction_layers if layer.headwise) > 32
    )  # attention's padded layout: a working copy, not the cache's bytes


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["engine.regime=chunked"],
            "policy snapkv+adakv evicts once, after the prompt, to a length per head: engine.regime=chunked evicts "
            "again",
        ),
        (
            ["engine.decode_evict=true"],
            "policy snapkv+adakv evicts once, after the prompt, to a length per head: engine.decode_evict=true evicts "
            "again",
        ),
    ],
)
def test_adakv_outside_its_definition_is_one_line(tmp_path, capsys, overrides, message):
    run = ["run", "model=tiny_llama", "policy=snapkv+adakv", *overrides, f"output_dir={tmp_path / 'run'}"]
    assert refused(capsys, run, tmp_path / "run") == f"kvbench: error: {message}\n"


def test_a_run_saves_each_heads_own_kept_positions(tmp_path):
    from tests.test_plan import TINY

    kvbench_main(["run", *TINY, "policy=snapkv+adakv", "budget=64", "engine.save_kept=true", f"output_dir={tmp_path}"])
    saved = [json.loads(path.read_text()) for path in sorted((tmp_path / "kept").glob("*.json"))]
    assert len(saved) == 2 and all(
        sum(map(len, layer)) == 64 * len(layer) for record in saved for layer in record["kept"]
    )
    assert any(len({len(head) for head in layer}) > 1 for record in saved for layer in record["kept"])


def test_a_length_per_head_layer_attends_the_padded_entries_then_the_tokens_appended_since(monkeypatch):
    """:meth:`EvictionLayer.attended` after a head-wise eviction: at every decode step exactly the padded entries
    followed by the tokens appended since, with each head's mask (the plain ``torch.cat`` of them), the padded layout
    made once per eviction and grown in place by each token, made again after another eviction or when the appended
    tokens move to a new storage (past ``APPEND_SPARE``)."""
    from kvbench.engine.entries import HeadwiseEntries
    from kvbench.engine.layer import APPEND_SPARE, EvictionLayer

    made = []
    padded = HeadwiseEntries.padded
    monkeypatch.setattr(HeadwiseEntries, "padded", lambda self, entries: made.append(1) or padded(self, entries))
    generator = torch.Generator().manual_seed(0)
    layer = EvictionLayer()
    heads, dim = 3, 8

    def step(tokens: int, position: int) -> None:
        keys, values = (torch.randn(1, heads, tokens, dim, generator=generator) for _ in range(2))
        layer.append(keys, values, torch.arange(position, position + tokens))

    def evict(length: int) -> None:
        kept = torch.rand(1, heads, length, generator=generator) < 0.5
        kept[..., -1] = True
        layer.keep_per_head(kept, torch.rand(1, heads, length, generator=generator))

    step(20, 0)
    evict(20)
    builds = []
    for position in range(20, 30 + APPEND_SPARE + 3):
        if position == 30:
            evict(layer.get_seq_length())
        step(1, position)
        keys, values, mask = layer.attended()
        entries = layer.headwise
        assert entries is not None
        assert torch.equal(keys, torch.cat([padded(entries, entries.keys), layer.keys], dim=2))
        assert torch.equal(values, torch.cat([padded(entries, entries.values), layer.values], dim=2))
        appended = torch.ones(heads, layer.get_seq_length(), dtype=torch.bool)
        assert torch.equal(mask, torch.cat([entries.mask(), appended], dim=-1))
        builds.append(len(made) // 2)
    assert builds[0] == 1 and builds[9] == 1  # one layout for the ten steps after the first eviction
    assert builds[10] == 2 and builds[10 + APPEND_SPARE] == 2  # one after the second, for APPEND_SPARE + 1 tokens
    assert builds[-2:] == [3, 3]  # the appended tokens moved to a new storage: made again, then grown


@pytest.mark.parametrize("heads, tokens", [(1, 1), (3, 7), (4, 33)])
def test_packed_entries_lie_in_each_heads_own_layout_slots(heads, tokens):
    """``HeadwiseEntries.packed`` on random kept masks (a head keeping one slot up to all): each head's kept entries in
    slot order, and in the padded ``[Hc, longest]`` layout at that head's row, one after another from its first slot,
    as a loop over the heads places them; nothing read back but the heads' lengths (``tolist``, which on a CPU
    dispatches nothing to count: no ``nonzero`` nor ``item``; on a GPU each read a synchronisation)."""
    from kvbench.engine.entries import HeadwiseEntries

    generator = torch.Generator().manual_seed(heads * tokens)
    for _ in range(10):
        kept = torch.rand(1, heads, tokens, generator=generator) < torch.rand(1, generator=generator)
        kept[0, :, -1] = True
        keys, values = torch.randn(2, 1, heads, tokens, 4, generator=generator)
        positions = torch.arange(tokens).expand(1, heads, tokens).clone()
        with Operators() as counted:
            entries = HeadwiseEntries.packed(keys, values, positions, torch.randn(1, heads, tokens), kept)
        assert counted.host_reads == 0
        longest = int(kept.sum(dim=-1).max())
        assert torch.equal(entries.positions, positions[kept])
        layout = torch.zeros(heads, longest, 4)
        for head in range(heads):
            own = keys[0, head][kept[0, head]]
            layout[head, : len(own)] = own
        assert entries.longest == longest
        assert torch.equal(entries.padded(entries.keys)[0], layout)
        assert torch.equal(entries.mask(), torch.arange(longest) < kept[0].sum(dim=-1)[:, None])


def test_the_head_wise_variants_of_a_shared_prefill_share_out_their_heads_together(monkeypatch):
    """Head-wise variants of one shared forward (three bases with AdaKV at two budgets, and another safeguard) keep
    what each keeps prefilled alone, their heads' shares made at each layer's end (one ``head_shares`` call for the
    variants of one setting, budget and reserved slots) and read back at once: no value read back a variant."""
    model, prompt = tiny_model(layers=LAYERS), random_prompt(120)
    specs = [f"{base}+adakv" for base in ("snapkv", "tova", "knorm")]
    engines = [engine(model, spec, budget) for spec in specs for budget in (40, 56)]
    engines.append(engine(model, "snapkv+adakv", 56, alpha_safeguard=0.5))
    alone = []
    for each in engines:
        cache = each.new_cache(len(prompt))
        each.prefill(cache, prompt)
        alone.append(cache.kept_by_head())
    shares, calls = AdaKV.head_shares, []
    monkeypatch.setattr(AdaKV, "head_shares", lambda self, *args: calls.append(1) or shares(self, *args))
    with Operators() as counted:
        rows = prefill_shared(engines, Prompt(prompt, 1), batch_size=len(engines))
    assert [row.cache.kept_by_head() for row in rows] == alone
    # a budget's SnapKV variant (its window reserved), its TOVA and KNorm variants (none reserved), the other setting
    assert len(calls) == 5 * LAYERS
    assert counted.host_reads == 0  # the shares read back by one .tolist() a layer (which a CPU does not count)
