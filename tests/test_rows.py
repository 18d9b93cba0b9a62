"""Decoding rows together (:func:`kvbench.engine.rows.decode_rows`): many (sample, variant) rows, each with its own
cache, budget, positions and stop tokens, step through one forward of the model and give what each gives alone."""

from __future__ import annotations

import pytest
import torch

import kvbench.engine.rows as engine_module
from kvbench import kernels
from kvbench.bench.measure import Operators
from kvbench.engine import Engine
from kvbench.engine.rows import Row, decode_rows, perplexity_rows
from kvbench.engine.shelf import capacity_class
from kvbench.engine.store import RowStore
from kvbench.kernels import decode
from kvbench.policies import build_policy
from tests.helpers import (
    ARCHITECTURES,
    VARIANTS,
    architecture_variants,
    assert_diverged_at_a_near_tie,
    assert_each_as_alone,
    assert_shared_gives_each_alone,
    generated_alone,
    generated_shared,
    random_prompt,
    rankings_by_policy,
    registry_engines,
    tiny_model,
)

#: how each architecture's rows attend in the test below (``engine.rows_attention``): every architecture's each alone;
#: Llama's also padded and stored, Qwen2's and Qwen3's also stored
ATTENDED_BY = {name: ("each",) for name in ARCHITECTURES} | {
    "llama": ("each", "padded", "stored"),
    "qwen2": ("each", "stored"),
    "qwen3": ("each", "stored"),
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_variants_decoded_as_rows_give_what_each_gives_alone(architecture):
    """Every base × {none, each applicable modifier} (the architecture's share: :func:`architecture_variants`), both
    head layouts, oneshot and chunked (which evicts at every decode step), decoded 16 rows at a time after one shared
    prefill, each row attended alone, or all the rows that hold every key padded into one call per layer, or held
    together (``engine.rows_attention``: :data:`ATTENDED_BY`): each variant's tokens, kept sets, cache sizes and
    policy statistics equal its own :meth:`Engine.generate`'s (float32), run once for every way the rows attend."""
    model = tiny_model(architecture)
    prompt = random_prompt(160)
    cases = [(32, "oneshot", {}), (48, "oneshot", {"gqa": "repeat"}), (48, "chunked", {})]
    variants, alone = architecture_variants(architecture), None
    for rows_attention in ATTENDED_BY[architecture]:
        settings = {"block_size": 64, "record_kept": True, "rows_attention": rows_attention}
        engines, _ = registry_engines(model, cases, len(prompt), variants=variants, **settings)
        assert len(engines) > 16 and {engine.regime for engine in engines} == {"oneshot", "chunked"}
        shared = generated_shared(engines, prompt, 8, batch_size=16)
        if alone is None:  # a row alone attends as it is (engine.rows_attention sets how rows attend together)
            alone = generated_alone(engines, prompt, 8)
        assert_each_as_alone(engines, alone, shared)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_rows_evicting_every_few_tokens_are_stored_between_evictions_as_each_alone(architecture, monkeypatch):
    """Every variant evicting while it decodes, every 5th token (oneshot, ``engine.decode_interval=5``), decoded 16
    rows at a time with the rows stored: those whose steps between evictions only append and attend (a ranking from
    the keys or a window of queries: ``store.stored_between_evictions``) are on the shelves for 4 steps of 5, the
    queries their next eviction reads kept by the store; each variant's tokens, kept sets, cache sizes, policy
    statistics and bytes after each step equal its own :meth:`Engine.generate`'s (float32)."""
    model = tiny_model(architecture)
    prompt = random_prompt(96)
    settings = {"record_kept": True, "rows_attention": "stored", "decode_interval": 5}
    engines, _ = registry_engines(
        model,
        [(32, "oneshot", {}), (40, "oneshot", {"gqa": "repeat"})],
        len(prompt),
        (False,),
        decode_evict=True,
        **settings,
    )
    stored: set[str] = set()
    begin_step = RowStore.begin_step

    def counted(store, caches, *args):
        alone = begin_step(store, caches, *args)
        stored.update(cache.policy.spec for place, cache in enumerate(caches) if place not in alone)
        return alone

    monkeypatch.setattr(RowStore, "begin_step", counted)
    shared = assert_shared_gives_each_alone(engines, prompt, 12, batch_size=16)
    alone = [engine.generate(prompt, 12) for engine in engines]
    assert [output.kv_curve for output in shared] == [output.kv_curve for output in alone]
    assert {"snapkv", "tova", "knorm", "sink", "rkv", "h2o", "h2o+obcache_joint"} <= stored
    assert not {"snapkv+adakv", "cake"} & stored


@pytest.mark.parametrize("spec", ["snapkv", "rkv"])
def test_a_stored_row_takes_back_the_queries_its_next_eviction_reads(spec):
    """A row evicting every 5th token, stored in between, holds when it leaves the store (its last 2 of 12 tokens
    stored) the window of queries and their positions it holds decoded alone (the queries within float32 rounding:
    the stored rows' attention is one padded call)."""
    model, prompt = tiny_model(), random_prompt(96)
    caches = []
    for rows_attention in ("each", "stored"):
        engine = Engine(
            model,
            build_policy(spec, {"window": 8}),
            24,
            decode_evict=True,
            decode_interval=5,
            rows_attention=rows_attention,
        )
        rows = [engine.prefilled_row(prompt, 12), engine.prefilled_row(prompt[:90], 12)]
        restoring = RowStore(restore=True) if rows_attention == "stored" else None  # a finished row's entries back
        decode_rows(rows, 2, store=restoring)
        caches.append(rows[0].cache)
    for alone, stored in zip(*(cache.eviction_layers for cache in caches)):
        assert torch.equal(alone.recent_query_positions, stored.recent_query_positions)
        assert alone.recent_query_positions.tolist() == list(range(96 + 12 - 1 - 8, 96 + 12 - 1))
        torch.testing.assert_close(alone.recent_queries, stored.recent_queries, rtol=1e-5, atol=1e-5)


GQA_MODES = ("sum", "mean", "repeat")
FUSED = pytest.mark.skipif(not kernels.available(), reason="triton is not installed")


@pytest.mark.parametrize(
    ("spec", "gqa", "sums_kernel"),
    [
        *((spec, gqa, "torch") for spec in ("h2o", "h2o+obcache_joint", "h2o+obcache_key") for gqa in GQA_MODES),
        pytest.param("h2o+obcache_joint", "sum", "triton", marks=[pytest.mark.kernel, FUSED]),
    ],
)
def test_a_stored_running_row_holds_the_running_score_it_holds_alone(spec, gqa, sums_kernel):
    """Rows evicting by a running score every 5th token, stored in between (their shelf adds the step's sums of
    every row by one pass over the regions padded to the longest), hold when they leave the store the running
    scores they hold decoded alone, every layer's: two rows of different budgets and prompts. Within float32 rounding:
    the stored rows' attention is one padded call, each query's normaliser taken over its own region; OBCache's key
    term ``‖v_p − o_i‖²`` cancels, 1.1e-4 relative at worst here (3.5e-6 with the model in float64, where the
    statistics' float32 logits are what rounds); with the shelf's sums left out it fails. ``engine.sums_kernel=triton``:
    the rows' and the shelf's sums by the fused pass (under Triton's interpreter on CPU)."""
    model, prompt = tiny_model(), random_prompt(96)
    caches = []
    for rows_attention in ("each", "stored"):
        rows = []
        for budget, tokens in ((24, prompt), (17, prompt[:90])):
            policy = build_policy(spec, {"window": 8, "gqa": gqa})
            engine = Engine(
                model,
                policy,
                budget,
                decode_evict=True,
                decode_interval=5,
                rows_attention=rows_attention,
                sums_kernel=sums_kernel,
            )
            rows.append(engine.prefilled_row(tokens, 12))
        decode_rows(rows, 2, store=RowStore(restore=True) if rows_attention == "stored" else None)
        caches.append([row.cache for row in rows])
    for budget, alone_cache, stored_cache in zip((24, 17), *caches):
        for alone, stored in zip(alone_cache.eviction_layers, stored_cache.eviction_layers):
            assert alone.running_score is not None and stored.running_score is not None
            assert alone.running_score.shape == stored.running_score.shape == (1, alone.keys.shape[1], budget + 1)
            torch.testing.assert_close(alone.running_score, stored.running_score, rtol=5e-4, atol=1e-5)
            assert torch.equal(alone.positions, stored.positions)


def test_rows_of_different_prompts_stop_alone_and_leave_the_batch(monkeypatch):
    """Rows of different prompt lengths (so different positions and cache lengths), token limits and stop tokens:
    each stops where it stops alone, the batch shrinks as rows finish, and waiting rows take the freed places."""
    model = tiny_model()
    engine = Engine(model, build_policy("snapkv", {"window": 8}), 24)
    prompts = [random_prompt(length, seed=length) for length in (40, 64, 90, 120, 33)]
    limits = [3, 9, 5, 12, 7]
    alone = [engine.generate(prompt, limit) for prompt, limit in zip(prompts, limits)]
    stops = [[alone[2].token_ids[2]], []]  # the third row stops on its own third token
    sizes: list[int] = []
    step_rows = engine_module.step_rows
    monkeypatch.setattr(
        engine_module, "step_rows", lambda stepping, store: sizes.append(len(stepping)) or step_rows(stepping, store)
    )
    rows = []
    for index, (prompt, limit) in enumerate(zip(prompts, limits)):
        cache = engine.new_cache(len(prompt))
        logits = engine.prefill(cache, prompt)[0, -1]
        rows.append(Row(engine, cache, logits, len(prompt), limit, stops[index != 2]))
    outputs = decode_rows(rows, batch_size=3)
    assert outputs[2].token_ids == alone[2].token_ids[:2]
    for index in (0, 1, 3, 4):
        assert outputs[index].token_ids == alone[index].token_ids
    steps = [
        len(output.token_ids) - (index != 2) for index, output in enumerate(outputs)
    ]  # a stopped row steps once more
    assert sum(sizes) == sum(steps) and sizes[0] == 3 and sizes[-1] == 1
    assert sizes == sorted(sizes, reverse=True)  # full until no row waits: a freed place is taken at once


def test_min_new_tokens_hold_per_row():
    """A row's stop tokens are banned for its own first ``min_new_tokens`` only."""
    model = tiny_model()
    engine = Engine(model, build_policy("tova"), 32)
    prompt = random_prompt(80)
    first = engine.generate(prompt, 6).token_ids
    stop = [first[0]]
    expected = [engine.generate(prompt, 6, stop, minimum) for minimum in (0, 2)]
    rows = []
    for minimum in (0, 2):
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), 6, stop, minimum))
    outputs = decode_rows(rows, batch_size=2)
    assert outputs[0].token_ids == [] and [output.token_ids for output in outputs] == [e.token_ids for e in expected]


@pytest.mark.parametrize("spec", ["snapkv", "snapkv+slake", "snapkv+calidrop"])
@pytest.mark.parametrize("rows_attention", ["each", "stored"])
def test_stored_rows_step_in_operators_per_layer_not_per_row(spec, rows_attention):
    """A decode step of rows that only append and attend (SLAKE's and CaliDrop's attention of what they evicted
    included), held together (``engine.rows_attention=stored``), dispatches as many operators for 12 rows as for 4
    (each layer one scatter and one attention for all); attended each alone, more with every row. The tokens are each
    row's alone."""
    model = tiny_model()
    engine = Engine(model, build_policy(spec, {"window": 8}), 24, rows_attention=rows_attention)
    prompts = [random_prompt(40 + 7 * index, seed=index) for index in range(12)]
    decode.counting(1, torch.device("cpu"))  # made once a process: not a step's

    def per_step(count: int) -> float:
        operators = []
        for new_tokens in (4, 8):
            rows = []
            for prompt in prompts[:count]:
                cache = engine.new_cache(len(prompt))
                rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), new_tokens))
            with Operators() as counted:
                outputs = decode_rows(rows, batch_size=count)
            operators.append(counted.launched)
        assert [output.token_ids for output in outputs] == [engine.generate(p, 8).token_ids for p in prompts[:count]]
        return (operators[1] - operators[0]) / 4

    few, many = per_step(4), per_step(12)
    assert few == many if rows_attention == "stored" else many > few + 8 * 4 * 2  # ≥ a few per row and layer


@pytest.mark.parametrize("restore", [False, True])
def test_a_store_lets_each_shelf_go_once_its_rows_have_left(monkeypatch, restore):
    """Rows of prompts of several lengths on shelves of several capacities, joining as places free: when the decode
    ends no shelf is held, and each row's tokens and sizes are those it gives alone; where the store restores them
    (a test's), every row has moved back into its own cache, else (a run's) a finished row leaves its entries."""
    model = tiny_model()
    engine = Engine(model, build_policy("full"), 400, rows_attention="stored")
    prompts = [random_prompt(length, seed=length) for length in (20, 40, 70, 130, 33)]
    alone = [engine.generate(prompt, 5) for prompt in prompts]
    stores: list[RowStore] = []
    monkeypatch.setattr(engine_module, "RowStore", lambda: stores.append(RowStore(restore)) or stores[-1])
    rows = []
    for prompt in prompts:
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), 5))
    outputs = decode_rows(rows, batch_size=2)
    assert [(output.token_ids, output.kv) for output in outputs] == [(output.token_ids, output.kv) for output in alone]
    assert len(stores) == 1 and stores[0].shelves == {} and stores[0].places == {}
    held = [len(prompt) + 4 if restore else 0 for prompt in prompts]
    assert [row.cache.get_seq_length() for row in rows] == held


@pytest.mark.parametrize("restore", [False, True])
@pytest.mark.parametrize(
    ("spec", "settings"),
    [("snapkv+slake", {}), ("snapkv+calidrop", {}), ("snapkv+calidrop", {"theta1": 1.1}), ("h2o+calidrop", {})],
)
def test_a_shelf_attends_an_attending_modifier_where_a_row_evicted_and_softmax_where_none_did(
    spec, settings, restore, monkeypatch
):
    """SLAKE's or CaliDrop's rows (recomputing at every step with ``theta1`` above 1) on one shelf a layer: a prompt
    under the budget (nothing evicted, no state) beside prompts that evicted more or fewer entries; each row's state
    moves onto the shelf (the row holds none while stored) and back (a finished row's where the store restores its
    entries, or where its statistics read it: CaliDrop's); each row's tokens and policy statistics (CaliDrop's steps
    counted while a row steps, not after; its evicted bytes) are its own alone."""
    model = tiny_model()
    engine = Engine(model, build_policy(spec, {"window": 8, **settings}), 48, rows_attention="stored")
    prompts = [random_prompt(length, seed=length) for length in (47, 90, 120)]
    limits = [3, 2, 3]
    alone = [engine.generate(prompt, limit) for prompt, limit in zip(prompts, limits)]
    rows = []
    for prompt, limit in zip(prompts, limits):
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), limit))
    modifier = engine.policy.modifiers[0]
    assert modifier.units(rows[0].cache.eviction_layers[0].state_of(modifier)) is None
    assert modifier.units(rows[1].cache.eviction_layers[0].state_of(modifier)) is not None
    assert {capacity_class(min(len(prompt), 48) + 3) for prompt in prompts} == {52}  # one shelf a layer
    held: list[bool] = []  # whether a row that evicted still holds its state while stored: moved, not copied
    step_rows = engine_module.step_rows
    monkeypatch.setattr(
        engine_module,
        "step_rows",
        lambda stepping, store: (
            step_rows(stepping, store),
            held.append(modifier.name in rows[2].cache.eviction_layers[0].modifier_state),
        )[0],
    )
    stores: list[RowStore] = []
    outputs = decode_rows(rows, batch_size=3, store=stores.append(RowStore(restore)) or stores[0])
    assert len(stores[0].places) == 0 and stores[0].peak_bytes > 0  # the rows were stored, and have left
    back = modifier.units(rows[2].cache.eviction_layers[0].state_of(modifier)) is not None
    assert held == [False, False] and back == (restore or modifier.reports_state)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in alone]
    assert [output.policy_stats for output in outputs] == [output.policy_stats for output in alone]


def test_a_capacity_class_spares_under_an_eighth_and_an_octave_holds_eight():
    """A row needing ``n`` slots gets ``n`` up to 16, above it ``n`` rounded up to an eighth of its octave: never less,
    under 12.5 % more, classes non-decreasing, eight in each octave."""
    classes = [capacity_class(needed) for needed in range(1, 5000)]
    assert classes[:16] == list(range(1, 17))
    assert all(needed <= given < needed * 1.125 for needed, given in enumerate(classes, start=1))
    assert classes == sorted(classes)
    assert len({given for given in classes if 1024 < given <= 2048}) == 8


@pytest.mark.parametrize("spec", ["full", "pyramidkv", "snapkv+adakv"])
def test_a_stores_shelves_hold_what_its_rows_reserve_and_an_eighth_at_most(spec):
    """Rows of prompts of several lengths (under PyramidKV a length per layer, under AdaKV one per head), joining as
    places free and leaving at different steps: the shelves at their largest held under 1.15 × the bytes the rows then
    reserved (their kept entries and the tokens to come), and each row's tokens, kept sets and sizes are those it
    gives decoded alone."""
    model = tiny_model()
    engine = Engine(model, build_policy(spec), 48, rows_attention="stored")
    prompts = [random_prompt(length, seed=length) for length in (60, 75, 90, 130, 170, 210, 97, 64, 150)]
    new_tokens = [3 + index % 4 for index in range(len(prompts))]
    alone = [engine.generate(prompt, count) for prompt, count in zip(prompts, new_tokens)]
    rows = []
    for prompt, count in zip(prompts, new_tokens):
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), count))
    if spec == "pyramidkv":
        assert len({length for row in rows for length in row.cache.tokens_per_layer()}) > 2
    if spec == "snapkv+adakv":
        assert any(row.cache.sizes_now().after_prefill_head_range for row in rows)  # a length per head
    store = RowStore()
    outputs = decode_rows(rows, batch_size=6, store=store)
    assert [(output.token_ids, output.kv) for output in outputs] == [(output.token_ids, output.kv) for output in alone]
    assert 0 < store.reserved_at_peak <= store.peak_bytes < 1.15 * store.reserved_at_peak
    assert store.shelves == {} and store.places == {} and store.reserved == 0


@pytest.mark.parametrize("layout", ["mixed", "by_capacity"])
@pytest.mark.parametrize("spec", ["snapkv+slake", "pyramidkv+calidrop"])
def test_modifier_rows_of_several_capacities_on_one_shelf_or_one_each_give_each_alone(spec, layout, monkeypatch):
    """Rows whose modifiers attend, of several capacities (a length per layer, answers of 3 and 40 tokens to come):
    on one shelf a layer (``mixed``, CUDA's: their regions gathered to the longest; the units of rows that left kept
    free among those stepping) or a shelf per capacity (``by_capacity``, a CPU's: viewed), each row's tokens and
    statistics are its own alone."""
    import kvbench.engine.shelf as shelf_module

    monkeypatch.setattr(shelf_module, "MODIFIER_SHELVES", layout)
    engine = Engine(tiny_model(), build_policy(spec, {"window": 8}), 48, rows_attention="stored")
    prompts, limits = [random_prompt(length, seed=length) for length in (90, 120, 75)], [3, 40, 12]
    alone = [engine.generate(prompt, limit) for prompt, limit in zip(prompts, limits)]
    rows = []
    for prompt, limit in zip(prompts, limits):
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), limit))
    shelves: list[int] = []
    step_rows = engine_module.step_rows
    monkeypatch.setattr(
        engine_module,
        "step_rows",
        lambda stepping, store: (step_rows(stepping, store), shelves.append(len(store.shelves)))[0],
    )
    whole: set[bool] = set()  # whether a shelf's step was every unit in order (its queries taken as they are)
    attend_modified = shelf_module.Shelf.attend_modified
    monkeypatch.setattr(
        shelf_module.Shelf, "attend_modified", lambda self, *args: whole.add(self.whole) or attend_modified(self, *args)
    )
    if layout == "mixed":  # the units of rows that left stay free: the others step among them
        monkeypatch.setattr(shelf_module.Shelf, "compact", lambda self: False)
    outputs = decode_rows(rows, batch_size=3)
    layers = len(rows[0].cache.layers)
    assert shelves[0] == layers if layout == "mixed" else shelves[0] > layers
    assert whole == ({True, False} if layout == "mixed" else {True})  # (by capacity: a row a shelf)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in alone]
    assert [output.policy_stats for output in outputs] == [output.policy_stats for output in alone]


@pytest.mark.kernel
@pytest.mark.skipif(not kernels.available(), reason="triton is not installed")
@pytest.mark.parametrize("spec", ["pyramidkv", "snapkv+adakv"])
def test_the_region_kernel_attends_stored_rows_as_each_alone(spec, monkeypatch):
    """The stored rows attended by the region kernel (``kvbench/kernels/decode.py``, what a GPU runs; here under
    Triton's interpreter): one call per layer and step covering every stored unit of the step — a length per layer
    (PyramidKV) or per head (AdaKV), rows joining and leaving — and each row's tokens, kept sets and sizes are those
    it gives decoded alone."""
    import kvbench.engine.shelf as shelf_module

    monkeypatch.setattr(shelf_module, "REGION_ATTENTION", "kernel")
    calls, attend = [], decode.region_attention
    monkeypatch.setattr(decode, "region_attention", lambda *args: calls.append(args[0].shape[0]) or attend(*args))
    model = tiny_model().to("cuda" if torch.cuda.is_available() else "cpu")  # compiled on a GPU, interpreted here
    engine = Engine(model, build_policy(spec), 48, rows_attention="stored")
    prompts = [random_prompt(length, seed=length) for length in (60, 130, 97, 64, 150)]
    new_tokens = [3, 5, 4, 3, 6]
    alone = [engine.generate(prompt, count) for prompt, count in zip(prompts, new_tokens)]
    rows = []
    for prompt, count in zip(prompts, new_tokens):
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), count))
    outputs = decode_rows(rows, batch_size=3)
    assert [(output.token_ids, output.kv) for output in outputs] == [(output.token_ids, output.kv) for output in alone]
    heads = rows[0].cache.cache_heads
    assert calls and max(calls) == 3 * heads and len(calls) % model.config.num_hidden_layers == 0


def test_a_decode_step_reads_nothing_back_row_by_row():
    """Rows that do not evict while decoding: the step's positions come from the host and every row's greedy token
    from one argmax (read back once: ``.tolist()``, no operator on a CPU), so no value is read back row by row; the
    tokens are each row's alone."""
    model = tiny_model()
    engine = Engine(model, build_policy("snapkv", {"window": 8}), 24)
    prompts = [random_prompt(length, seed=length) for length in (40, 64, 90, 33)]
    alone = [engine.generate(prompt, 6) for prompt in prompts]
    rows = []
    for prompt in prompts:
        cache = engine.new_cache(len(prompt))
        rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), 6))
    with Operators() as counted:
        outputs = decode_rows(rows, batch_size=4)
    assert counted.host_reads == 0
    assert [output.token_ids for output in outputs] == [output.token_ids for output in alone]


@pytest.mark.model
@pytest.mark.slow
def test_on_smollm2_chunked_variants_decoded_as_rows_give_what_each_gives_alone():
    """Every variant over the registry on the offline SmolLM2 (float32) in the chunked regime, which evicts at every
    decode step, decoded 8 rows at a time: tokens, kept sets, cache sizes and policy statistics equal each alone's
    (the oneshot registry: ``test_groups.py::test_on_smollm2_one_shared_prefill_gives_what_each_variant_gives_alone``).
    """
    from kvbench.bench.sections import PARAGRAPH, prompt_tokens
    from kvbench.models import load_model, model_config

    loaded = load_model(model_config("smollm2_135m"))
    prompt = prompt_tokens(loaded.tokenizer, PARAGRAPH, 384)
    engines, _ = registry_engines(loaded.model, [(96, "chunked", {})], len(prompt), (False,), record_kept=True)
    assert len(engines) > len(VARIANTS) / 2
    assert_shared_gives_each_alone(engines, prompt, 8, batch_size=8)


@pytest.mark.parametrize("batch_size", ["3", "auto"])
def test_a_batched_run_and_group_give_what_batch_1_gives(tmp_path, batch_size):
    """A single run of 4 samples decoding ``batch_size`` rows together, and a group of 4 variants sharing each prefill
    and decoding its (sample, variant) rows together, write the predictions and kept sets of batch-1 runs; the batch
    size is not part of a run's identity (the same directory resumes under another)."""
    from kvbench.config import compose
    from kvbench.run import run, run_group
    from tests.test_groups import TINY, outcome

    def single(size: str, where: str) -> None:
        run(compose([*TINY, "task.num_samples=4", "policy=snapkv+calidrop", "budget=64", size]), tmp_path / where)

    single("engine.batch_size=1", "one")
    single(f"engine.batch_size={batch_size}", "rows")
    assert outcome(tmp_path / "rows") == outcome(tmp_path / "one")
    single("engine.batch_size=1", "rows")  # finished: nothing to run under another batch size
    specs = ("h2o", "tova+caote", "pyramidkv", "sink")
    for size, where in (("1", "group-one"), (batch_size, "group-rows")):
        cfgs = [
            compose([*TINY, "task.num_samples=3", f"policy={spec}", "budget=64", f"engine.batch_size={size}"])
            for spec in specs
        ]
        run_group([(cfg, tmp_path / where / spec) for cfg, spec in zip(cfgs, specs)], share_prefill=True)
    for spec in specs:
        assert outcome(tmp_path / "group-rows" / spec) == outcome(tmp_path / "group-one" / spec), spec


def test_auto_batch_size_fits_the_free_memory(monkeypatch):
    """``engine.batch_size=auto`` decodes as many rows as half the free memory holds at each row's heaviest (its
    full cache and logits), at least one, at most ``AUTO_MAX_ROWS``."""
    model = tiny_model()
    engines = [Engine(model, build_policy("snapkv"), 64), Engine(model, build_policy("snapkv", {"gqa": "repeat"}), 64)]
    heaviest = engines[1].row_bytes(1000, 24)
    assert heaviest > engines[0].row_bytes(1000, 24)
    for free, rows in ((10 * heaviest, 5), (heaviest, 1), (0, 1), (10**15, engine_module.AUTO_MAX_ROWS)):
        monkeypatch.setattr(engine_module, "free_memory", lambda device, free=free: free)
        assert engine_module.batch_rows("auto", engines, 1000, 24) == rows
    assert engine_module.batch_rows(7, engines, 1000, 24) == 7


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_variants_streaming_a_text_as_rows_give_the_nlls_of_each_alone(architecture):
    """Every base × {none, each applicable modifier} (the architecture's share: :func:`architecture_variants`) in the
    oneshot, chunked and streaming regimes scoring one text (a 40-token context, then 40 tokens evicting as they
    decode), 16 rows at a time in lockstep: each variant's NLLs equal its own :meth:`Engine.perplexity`'s to 1e-5
    (relative: a row's matrix products over a block of several rows round in the last float32 bits), its cache sizes
    and policy statistics exactly; or, where a variant's differ, its rankings were alike within 1e-4 until an eviction
    kept other slots (a near-tie: on an AVX-512 CPU a 16-bit KNorm norm rounded one step apart, KNorm+SLAKE streaming
    on Phi-3 when every architecture ran every variant)."""
    model = tiny_model(architecture)
    text = random_prompt(80)
    cases = [(32, regime, {}) for regime in ("oneshot", "chunked", "streaming")]
    variants = architecture_variants(architecture)
    engines, _ = registry_engines(model, cases, 40, (False,), decode_evict=True, block_size=16, variants=variants)
    assert len(engines) > 16 and {engine.regime for engine in engines} == {"oneshot", "chunked", "streaming"}
    alone = [engine.perplexity(text, 40) for engine in engines]
    rows = perplexity_rows(engines, text, 40, batch_size=16)
    differing = []
    for engine, one, other in zip(engines, alone, rows):
        assert len(other.nlls) == len(one.nlls) == len(text) - 40, f"{engine.policy.spec} {engine.regime}"
        apart = max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(one.nlls, other.nlls))
        if apart > 1e-5 or (other.kv, other.policy_stats) != (one.kv, one.policy_stats):
            differing.append(engine)
    if differing:  # run again (the same computation), their rankings recorded
        with rankings_by_policy() as ranked_alone:
            for engine in differing:
                engine.perplexity(text, 40)
        with rankings_by_policy() as ranked_rows:
            perplexity_rows(engines, text, 40, batch_size=16)
    for engine in differing:
        ranked, label = id(engine.policy), f"{engine.policy.spec} {engine.regime}"
        assert_diverged_at_a_near_tie(ranked_alone.get(ranked, []), ranked_rows.get(ranked, []), label)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_free_memory_keeps_within_the_memory_cgroup(tmp_path, monkeypatch, version):
    """On the host, ``auto``'s free memory is the available memory, or less where the process's memory cgroup (a
    Slurm job's, a container's) admits less: the tightest limit less usage over its cgroup and those above it."""
    import torch

    from kvbench.engine import memory

    mount = tmp_path if version == "v2" else tmp_path / "memory"
    limit, usage = memory.V2_FILES if version == "v2" else memory.V1_FILES
    job = mount / "slurm" / "job_7"
    job.mkdir(parents=True)
    (mount / "slurm" / limit).write_text("3000000000\n")  # the parent's limit: 3 GB, 1 GB used
    (mount / "slurm" / usage).write_text("1000000000\n")
    (job / limit).write_text("max\n" if version == "v2" else f"{memory.NO_LIMIT * 4}\n")  # no limit of its own
    (job / usage).write_text("500000000\n")
    line = "0::/slurm/job_7" if version == "v2" else "4:memory:/slurm/job_7"
    (tmp_path / "cgroup").write_text(f"9:name=systemd:/\n{line}\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "cgroup")
    assert memory.cgroup_headroom() == 2_000_000_000
    assert memory.free_memory(torch.device("cpu")) == min(2_000_000_000, memory.psutil.virtual_memory().available)
    (job / limit).write_text("700000000\n")  # a tighter limit of its own
    assert memory.cgroup_headroom() == 200_000_000
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "absent")
    assert memory.cgroup_headroom() is None


def test_samples_are_given_in_order_as_soon_as_their_rows_finish():
    """A chunk's samples come in their order, each once all its rows have finished, whatever order rows finish in: a
    grouped run writes a sample's records as soon as it can without reordering its predictions."""
    from kvbench.run import in_sample_order

    seen: list[str] = []

    def finishing():
        for row, output in ((2, "c"), (0, "a"), (3, "d"), (1, "b")):
            seen.append(output)
            yield row, output

    given = []
    for position, outputs in in_sample_order(finishing(), [0, 0, 1, 2], 4):
        given.append((position, outputs, len(seen)))
    assert given == [(0, [(0, "a"), (1, "b")], 4), (1, [(2, "c")], 4), (2, [(3, "d")], 4), (3, [], 4)]
    early = list(in_sample_order(iter([(0, "a"), (1, "b")]), [0, 1], 3))
    assert early == [(0, [(0, "a")]), (1, [(1, "b")]), (2, [])]


def test_rows_made_on_demand_join_the_batch_as_they_fit_and_give_what_each_gives_alone(monkeypatch):
    """Groups of rows made on demand (a grouped sweep's samples, each prefilled for its variants): a group is made
    only once its rows fit in the batch beside the rows made and not finished, so it joins while the rows before it
    finish (a step holds rows of two groups), no more rows are ever held than the batch; each row's tokens are its
    engine's alone."""
    model = tiny_model()
    engines = [Engine(model, build_policy("snapkv", {"window": 8}), budget) for budget in (16, 24, 32)]
    prompts = [random_prompt(length, seed=length) for length in (40, 64, 90, 120)]
    limits = [3, 9, 5, 12]
    alone = [  # each variant its own limit: a group's rows finish at different steps
        [engine.generate(prompt, limit + 3 * place).token_ids for place, engine in enumerate(engines)]
        for prompt, limit in zip(prompts, limits)
    ]
    rows: list[Row] = []
    finished: list[int] = []
    held: list[int] = []  # rows made and not finished, at each group made and at each step
    group_of: list[int] = []
    steps: list[set[int]] = []
    step_rows = engine_module.step_rows

    def stepped(stepping, store):
        held.append(len(rows) - len(finished))
        steps.append({group_of[rows.index(row)] for row, _ in stepping})
        return step_rows(stepping, store)

    monkeypatch.setattr(engine_module, "step_rows", stepped)

    def group(number: int):
        def make() -> list[Row]:
            made = []
            for place, engine in enumerate(engines):
                cache = engine.new_cache(len(prompts[number]))
                logits = engine.prefill(cache, prompts[number])[0, -1]
                made.append(Row(engine, cache, logits, len(prompts[number]), limits[number] + 3 * place))
            group_of.extend([number] * len(made))
            rows.extend(made)
            held.append(len(rows) - len(finished))
            return made

        return len(engines), make

    for index, output in engine_module.finished_rows([], 5, (group(number) for number in range(len(prompts)))):
        finished.append(index)
        assert output.token_ids == alone[group_of[index]][index % len(engines)]
    assert sorted(finished) == list(range(len(prompts) * len(engines)))
    assert max(held) <= 5 and any(len(groups) == 2 for groups in steps)


def test_finished_rows_are_let_go_so_a_long_sweep_holds_only_the_batch():
    """A row that has finished is not held by the decoding: however many groups are decoded, the rows alive (their
    caches) are at most the batch, not every row decoded so far (what grew a grouped sweep's memory sample after
    sample)."""
    import gc
    import weakref

    model = tiny_model()
    engines = [Engine(model, build_policy("snapkv", {"window": 8}), budget) for budget in (16, 24)]
    made: list[weakref.ref] = []
    alive: list[int] = []

    def group(number: int):
        def make() -> list[Row]:
            prompt = random_prompt(40 + number, seed=number)
            rows = []
            for engine in engines:
                cache = engine.new_cache(len(prompt))
                rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), 2 + number % 3))
            made.extend(weakref.ref(row.cache) for row in rows)
            return rows

        return len(engines), make

    for _ in engine_module.finished_rows([], 4, (group(number) for number in range(12))):
        gc.collect()
        alive.append(sum(ref() is not None for ref in made))
    assert len(made) == 24 and len(alive) == 24
    assert max(alive) <= 4, alive


def test_samples_whose_rows_are_made_as_they_decode_are_given_once_made_and_finished():
    """Rows made as they decode: ``sample_of`` grows with them and a sample is given only once its rows are made (a
    sample without rows, once the samples before it are given and it is made)."""
    from kvbench.run import in_sample_order

    sample_of: list[int] = [0]
    made = [1]
    events = [0]  # rows finished so far

    def finishing():
        events[0] += 1
        yield 0, "a"  # sample 0's one row: sample 1 (no rows) is not made yet
        sample_of.extend([2, 2])
        made[0] = 3  # samples 1 and 2 made
        events[0] += 1
        yield 2, "c"
        events[0] += 1
        yield 1, "b"

    given = [(*item, events[0]) for item in in_sample_order(finishing(), sample_of, 4, lambda: made[0])]
    assert given == [(0, [(0, "a")], 1), (1, [], 2), (2, [(2, "c"), (1, "b")], 3), (3, [], 3)]


def test_auto_stores_the_rows_on_a_gpu_and_names_the_run_as_each():
    """``engine.rows_attention=auto`` (the default): the rows held together on a CUDA device, where each call is a
    kernel launch, each attended alone on a CPU; a run of ``auto`` is named as one of ``each`` (the name every run had
    before the setting), one of ``stored`` otherwise."""
    import torch

    from kvbench.config import compose
    from kvbench.engine.runner import rows_attention_on
    from kvbench.rundir import run_name

    assert rows_attention_on(torch.device("cuda")) == "stored" and rows_attention_on(torch.device("cpu")) == "each"
    assert rows_attention_on(torch.device("cuda"), "each") == "each"
    assert Engine(tiny_model(), build_policy("snapkv"), 48).rows_attention == "each"
    names = {
        setting: run_name(_root_=compose(["model=tiny_llama", "policy=snapkv", f"engine.rows_attention={setting}"]))
        for setting in ("auto", "each", "stored")
    }
    assert compose([]).engine.rows_attention == "auto"
    assert names["auto"] == names["each"] != names["stored"]


def test_a_shared_prefills_variants_of_one_ranking_and_budget_select_and_gather_once(monkeypatch):
    """SnapKV alone, with CaliDrop and with SLAKE (one ranking) at one budget, and H2O (another ranking, the same
    reserved slots), prefilled by one shared forward: each layer's slots are selected by one top-k for the four
    (``SharedForward.select``: one selection for the first three, stacked with H2O's), the two rankings' entries
    gathered by one gather (their positions by another), the entries SnapKV's selection drops, handed to CaliDrop and
    SLAKE, by another (``SharedForward.drop``), and each variant's tokens, kept sets, sizes and statistics are its own
    alone."""
    import kvbench.engine.sharing as sharing_module
    from tests.helpers import assert_each_as_alone, generated_shared

    model = tiny_model()
    specs = ("snapkv", "snapkv+calidrop", "snapkv+slake", "h2o")
    engines = [Engine(model, build_policy(spec, {"window": 8}), 48, record_kept=True) for spec in specs]
    prompt = random_prompt(120)
    alone = [engine.generate(prompt, 4) for engine in engines]
    selections: list[int] = []
    gathers: list[int] = []
    views: list[bool] = []
    top_slots, take_flat, same_view = sharing_module.top_slots, sharing_module.take_flat, sharing_module.same_view
    monkeypatch.setattr(
        sharing_module, "top_slots", lambda scores, *args: selections.append(len(scores)) or top_slots(scores, *args)
    )
    monkeypatch.setattr(sharing_module, "take_flat", lambda *args: gathers.append(1) or take_flat(*args))
    monkeypatch.setattr(sharing_module, "same_view", lambda *args: views.append(same_view(*args)) or views[-1])
    shared = generated_shared(engines, prompt, 4, batch_size=4)
    assert selections == [2] * model.config.num_hidden_layers  # two selections stacked, once a layer
    assert len(gathers) == 2 * model.config.num_hidden_layers  # both rankings' kept entries, then those dropped
    assert views and all(views)  # the variants' entries and positions views of the prompt's: gathered at once
    assert_each_as_alone(engines, alone, shared)


def test_a_shelf_steps_its_units_again_by_one_addition(monkeypatch):
    """A step of the last step's units (the same layout, none placed or taken) finds where each writes and how long it
    is by adding one to the last step's: one addition and the device's lengths written (2 operators a shelf; the
    host's lengths counted when read, by one write for every step since), not gathered again; the tokens each row's
    alone, and the entries each row's cache holds when it leaves the store (read by the host's lengths) those it holds
    attended alone (within float32 rounding)."""
    from kvbench.engine.shelf import Shelf

    model = tiny_model()
    prompts = [random_prompt(length, seed=length) for length in (40, 64, 90)]
    counts: list[int] = []
    begin_step = Shelf.begin_step

    def counted(self, *args):
        with Operators() as operators:
            begin_step(self, *args)
        counts.append(operators.launched)

    monkeypatch.setattr(Shelf, "begin_step", counted)
    decoded = {}
    for attention in ("each", "stored"):
        engine = Engine(model, build_policy("snapkv", {"window": 8}), 24, rows_attention=attention)
        rows = []
        for prompt in prompts:
            cache = engine.new_cache(len(prompt))
            rows.append(Row(engine, cache, engine.prefill(cache, prompt)[0, -1], len(prompt), 6))
        outputs = decode_rows(rows, batch_size=3, store=RowStore(restore=True) if attention == "stored" else None)
        decoded[attention] = [output.token_ids for output in outputs], rows
    assert decoded["stored"][0] == decoded["each"][0]
    for stored, alone in zip(decoded["stored"][1], decoded["each"][1]):
        for ours, theirs in zip(stored.cache.eviction_layers, alone.cache.eviction_layers):
            # (within float32 rounding: a shelf attends its regions by one padded call, each alone its own)
            torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)
    layers = model.config.num_hidden_layers
    assert len(counts) == 5 * layers  # a shelf a layer, each step after the prompt's token
    assert counts[layers:] == [2] * 4 * layers and min(counts[:layers]) > 2
