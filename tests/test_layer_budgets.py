"""Layer budgets: CAKE's preference and cascading allocation, SLAKE's VABS, conserved totals."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.bench.measure import Operators
from kvbench.budgets import Budget
from kvbench.config import compose
from kvbench.engine import Engine
from kvbench.engine.attention import sdpa_attention
from kvbench.engine.cache import EvictionCache
from kvbench.engine.cascade import CascadeStages
from kvbench.errors import KVBenchError
from kvbench.job import resolve
from kvbench.policies import build_policy
from kvbench.policies.layer_budget import CascadingAllocation, build_layer_budget, conserve_total
from kvbench.policies.methods.cake import CAKE_TAU, cake_preference
from kvbench.policies.methods.slake import ptaa_weights, vabs_preference
from tests.helpers import random_prompt, tiny_model
from tests.test_policies import KV_HEADS, Q_HEADS, SCALING, TOKENS, random_layer, top_positions

PREFERENCES = [3.0, 0.5, 1.25, 7.0, 2.0]


def window_weights(seed: int, window: int):
    """Causal attention weights ``[1,Hq,W,T]`` of the last ``window`` queries of a random layer."""
    queries, keys, values = random_layer(seed)
    logits = torch.einsum("bhwd,bhtd->bhwt", queries[:, :, -window:], keys.repeat_interleave(2, 1)) * SCALING
    future = torch.arange(TOKENS)[None, :] > torch.arange(TOKENS - window, TOKENS)[:, None]
    return logits.masked_fill(future, float("-inf")), values


def test_cake_preference_is_entropy_and_variance_of_the_window():
    logits, _ = window_weights(0, 6)
    weights = logits.softmax(-1)
    tau1, tau2 = 1.6, 0.6
    entropy = variance = 0.0
    for head in range(Q_HEADS):
        for token in range(TOKENS - 6):
            column = [weights[0, head, i, token].item() for i in range(6)]
            entropy -= sum(a * math.log(a) for a in column if a > 0)
            mean = sum(column) / 6
            variance += sum((a - mean) ** 2 for a in column) / 5
    expected = entropy ** (1 / tau1) * variance ** (1 / tau2)
    assert float(cake_preference(weights, tau1, tau2)) == pytest.approx(expected, rel=1e-4)


def test_vabs_preference_follows_eqs_15_to_18():
    logits, values = window_weights(1, 5)
    weights = logits.softmax(-1)
    evicted = torch.zeros(1, Q_HEADS, 1, TOKENS, dtype=torch.bool)
    evicted[..., 3:20] = True
    approximate = ptaa_weights(logits, evicted)
    values = values.repeat_interleave(2, 1)
    alpha, beta, gamma = 0.4, 0.2, 0.1
    products, entropies = [], []
    for head in range(Q_HEADS):
        norms = [values[0, head, j].norm().item() for j in range(TOKENS)]
        for i in range(5):
            errors = [abs(approximate[0, head, i, j].item() - weights[0, head, i, j].item()) for j in range(TOKENS)]
            total_variation = 0.5 * sum(errors)  # eq. 15
            value_aware = sum(n / sum(norms) * e for n, e in zip(norms, errors)) ** gamma  # eq. 16
            products.append(total_variation * value_aware)
            entropies.append(-sum(a * math.log(a) for a in weights[0, head, i].tolist() if a > 0))  # eq. 17
    expected = (sum(products) / len(products)) ** alpha * (sum(entropies) / len(entropies)) ** beta  # eq. 18
    assert float(vabs_preference(logits, evicted, values, alpha, beta, gamma)) == pytest.approx(expected, rel=1e-4)


def test_conserve_total_is_proportional_and_respects_caps():
    total = 40
    shares = conserve_total(PREFERENCES, total)
    exact = [p / sum(PREFERENCES) * total for p in PREFERENCES]
    assert sum(shares) == total and all(abs(s - e) < 1 for s, e in zip(shares, exact))
    capped = conserve_total(PREFERENCES, total, caps=[100, 100, 100, 12, 100])
    assert sum(capped) == total and capped[3] == 12
    rest = [p / (sum(PREFERENCES) - 7.0) * (total - 12) for i, p in enumerate(PREFERENCES) if i != 3]
    assert all(abs(s - e) < 1 for s, e in zip(capped[:3] + capped[4:], rest))
    assert conserve_total(PREFERENCES, 1000, caps=[5, 6, 7, 8, 9]) == [5, 6, 7, 8, 9]
    assert conserve_total([0.0, 0.0], 7) in ([4, 3], [3, 4])


def test_cascading_stages_follow_cake_and_end_at_the_proportional_allocation():
    """Stage m: ``B_l = r + P_l / Σ_{k≤m} P_k · (b − r) · L`` capped by what each layer holds; no layer grows."""
    budget, reserved, layers, prompt = 24, 4, len(PREFERENCES), 300
    allocation = CascadingAllocation(budget, reserved, layers)
    sizes: list[int] = []
    for stage, preference in enumerate(PREFERENCES):
        budgets = allocation.stage(preference, sizes + [prompt])
        seen = PREFERENCES[: stage + 1]
        exact = [reserved + p / sum(seen) * (budget - reserved) * layers for p in seen]
        caps = sizes + [prompt]
        assert all(b <= c for b, c in zip(budgets, caps))
        assert all(abs(b - e) < 1 for b, e, c in zip(budgets, exact, caps) if e < c - 1)
        sizes = [min(s, b) for s, b in zip(caps, budgets)]
    assert sum(sizes) == budget * layers
    direct = [reserved + share for share in conserve_total(PREFERENCES, (budget - reserved) * layers)]
    assert all(abs(s - d) <= 1 for s, d in zip(sizes, direct))


def test_cake_indicator_is_window_mean_plus_gamma_variance():
    """The cake base keeps the window plus the top tokens by pooled ``mean + γ·var`` of the window's
    attention (summed over each KV group), as a direct computation gives."""
    budget, window, gamma, seed = 18, 6, 200.0, 2
    policy = build_policy("cake", {"window": window, "gamma": gamma, "pool": "none", "layer_budget": "uniform"})
    cache = EvictionCache(policy, [budget], TOKENS, Q_HEADS, KV_HEADS)
    queries, keys, values = random_layer(seed)
    cache.begin_forward(torch.arange(TOKENS), evict=True)
    cache.update(keys, values, 0)
    cache.after_attention(0, queries, sdpa_attention(queries, keys, values, SCALING), SCALING)
    logits, _ = window_weights(seed, window)
    weights = logits.softmax(-1)
    indicator = weights.mean(dim=2) + gamma * weights.var(dim=2)  # [1,Hq,T]
    scores = indicator.view(1, KV_HEADS, 2, TOKENS).sum(2)
    prefix = list(range(TOKENS - window))
    for head in range(KV_HEADS):
        kept = set(cache.layers[0].positions[0, head].tolist())
        expected = set(range(TOKENS - window, TOKENS)) | top_positions(
            scores[0, head].tolist(), prefix, budget - window
        )
        assert kept == expected


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", layers=4)


VABS = {"name": "vabs", "alpha": 0.5, "beta": 0.4}


@pytest.mark.parametrize(
    "spec,params",
    [
        ("cake", {}),
        ("cake+slake", {"layer_budget": VABS}),
        ("snapkv", {"layer_budget": VABS}),
        ("h2o", {"layer_budget": "cake"}),
    ],
)
def test_dynamic_budgets_differ_per_layer_and_conserve_the_total(llama, spec, params):
    budget = 40
    output = Engine(llama, build_policy(spec, {"window": 8, **params}), budget).generate(random_prompt(200), 4)
    per_layer = output.kv.after_prefill_tokens_per_layer
    assert sum(per_layer) == budget * 4 and len(set(per_layer)) > 1
    preferences = output.policy_stats["layer_preference"]
    direct = [8 + share for share in conserve_total(preferences, (budget - 8) * 4)]  # window 8 kept everywhere
    assert all(abs(got - want) <= 1 for got, want in zip(per_layer, direct))


@pytest.mark.parametrize("kind", ["cake", "vabs"])
@torch.inference_mode()
def test_cascading_equals_evicting_once_to_the_final_budgets(llama, kind):
    """Shrinking earlier layers as later preferences arrive keeps exactly what one eviction to the final
    budgets keeps (each layer ranked once), in every layer."""
    prompt, budget = random_prompt(150), 36
    layer_budget = VABS if kind == "vabs" else kind
    runner = Engine(llama, build_policy("snapkv", {"window": 8, "layer_budget": layer_budget}), budget)
    cascaded = runner.new_cache(len(prompt))
    runner.prefill(cascaded, prompt)
    static = Engine(llama, build_policy("snapkv", {"window": 8}), budget)
    once = EvictionCache(static.policy, cascaded.layer_budgets, len(prompt), 4, 2)
    static.prefill(once, prompt)
    assert once.tokens_per_layer() == cascaded.tokens_per_layer() == cascaded.layer_budgets
    for a, b in zip(cascaded.layers, once.layers):
        assert torch.equal(a.positions, b.positions)


def test_unknown_layer_budget_is_one_line_error():
    with pytest.raises(
        KVBenchError, match=r"unknown policy.layer_budget 'adaptive'; valid choices: cake, pyramid, uniform, vabs"
    ):
        build_layer_budget("adaptive")
    with pytest.raises(KVBenchError, match=r"unknown key policy.layer_budget.tau1 for layer budget vabs; valid keys: "):
        build_layer_budget({"name": "vabs", "tau1": 1.0})


@pytest.mark.parametrize("model", ["llama2_7b_chat", "llama31_8b", "mistral7b_v03"])
@pytest.mark.parametrize("budget", [128, 256])
def test_slake_experiment_runs_table_3_exponents(model, budget):
    """The policy that ``+experiment=slake`` builds for cake+slake carries SLAKE Table 3's α, β for the model
    and budget (checked on the built object), and an explicit value still wins."""
    settings = ["+experiment=slake", f"model={model}", "policy=cake+slake", f"budget={budget}", "task=longbench"]
    table3 = {
        ("llama2_7b_chat", 128): (0.5, 0.4), ("llama2_7b_chat", 256): (0.5, 0.4),
        ("llama31_8b", 128): (0.4, 0.2), ("llama31_8b", 256): (0.6, 0.5),
        ("mistral7b_v03", 128): (0.6, 0.5), ("mistral7b_v03", 256): (0.4, 0.2),
    }  # fmt: skip
    job = resolve(compose(settings))
    assert (job.policy.layer_budget.name, job.policy.layer_budget.alpha, job.policy.layer_budget.beta) == (
        "vabs",
        *table3[model, budget],
    )
    assert dict(job.cfg.policy.layer_budget) == {
        "name": "vabs",
        "alpha": table3[model, budget][0],
        "beta": table3[model, budget][1],
        "gamma": 0.1,
        "stand_in": {},
    }
    explicit = resolve(compose([*settings, "policy.layer_budget.alpha=0.9"])).policy.layer_budget
    assert (explicit.alpha, explicit.beta) == (0.9, table3[model, budget][1])


def test_vabs_without_table_entry_is_one_line_error():
    with pytest.raises(KVBenchError) as error:
        resolve(compose(["+experiment=slake", "model=qwen25_7b", "policy=cake+slake", "budget=128"]))
    assert "\n" not in str(error.value)
    assert "Qwen/Qwen2.5-7B-Instruct" in str(error.value) and "policy.layer_budget.alpha" in str(error.value)
    with pytest.raises(KVBenchError, match="at budget 512"):
        resolve(compose(["+experiment=slake", "model=llama31_8b", "policy=cake+slake", "budget=512"]))


def test_cake_takes_the_released_tau_per_model_and_budget():
    """CAKE's released model2tau.json values where it has the model and budget, its 1.0 fallback elsewhere,
    an explicit value over both; ``cake+slake`` with ``layer_budget=cake`` is SLAKE Table 2's middle row."""
    assert resolve(compose(["model=llama31_8b", "policy=cake", "budget=128"])).policy.layer_budget.tau1 == 1.6
    assert CAKE_TAU["meta-llama/Llama-3.1-8B-Instruct"][128] == (1.6, 0.6)
    cake = resolve(compose(["model=llama31_8b", "policy=cake", "budget=256"])).policy.layer_budget
    assert (cake.tau1, cake.tau2) == (1.0, 1.0)
    ablation = resolve(compose(["model=mistral7b_v03", "policy=cake+slake", "budget=128", "policy.layer_budget=cake"]))
    assert (ablation.policy.layer_budget.name, ablation.policy.layer_budget.tau1) == ("cake", 1.0)
    assert ablation.policy.spec == "cake+slake"
    explicit = build_layer_budget({"name": "cake", "tau1": 2.0}).for_model(
        "meta-llama/Llama-3.1-8B-Instruct", Budget.parse("128")
    )
    assert (explicit.tau1, explicit.tau2) == (2.0, 0.6)


@pytest.mark.model
@pytest.mark.parametrize("spec", ["cake", "cake+slake"])
def test_smollm2_dynamic_budgets(spec):
    from kvbench.models import load_model, model_config

    model, budget = load_model(model_config("smollm2_135m")).model, 64
    params = {"layer_budget": VABS} if spec == "cake+slake" else {}
    output = Engine(model, build_policy(spec, params), budget).generate(random_prompt(400, vocab=2000), 2)
    per_layer = output.kv.after_prefill_tokens_per_layer
    assert sum(per_layer) == budget * 30 and len(set(per_layer)) > 5
    assert min(per_layer) >= 32  # the observation window is kept in every layer


@pytest.mark.parametrize(
    "spec,params,recorded",
    [
        ("cake", {}, True),
        ("snapkv", {"layer_budget": VABS}, True),
        ("cake+calidrop", {}, True),  # attending, merging: the entries of every stage at once
        ("cake+calidrop", {"calib_size": 20}, True),
        ("cake+slake", {"layer_budget": VABS}, True),
        ("snapkv+slake", {"layer_budget": VABS}, True),
        ("lagkv+slake", {"layer_budget": VABS, "lag_size": 16, "window": None}, False),  # its ranks tie
        ("cake+adakv", {}, True),  # head-wise: kept sets nested in the budget
    ],
)
@torch.inference_mode()
def test_a_cascade_selects_and_gathers_each_layer_once_and_keeps_what_evicting_at_every_stage_keeps(
    llama, spec, params, recorded, monkeypatch
):
    """A cascade shrinks earlier layers at every stage. Where nothing reads the entries an eviction drops before
    decoding (nothing attends, or SLAKE and CaliDrop, which merge them), a layer is selected once, at its last budget;
    elsewhere each stage selects, and the keys/values are gathered once, when the forward ends, and the stages are
    shared then too, their preferences read back at once (none read per layer). Either way: the same entries, bytes,
    preferences and decoded tokens as evicting and gathering at every stage, and SLAKE's sums and CaliDrop's store and
    attention over it within float32 rounding (merged at once or stage by stage)."""
    import kvbench.engine.cache as cache_module
    import kvbench.engine.layer as layer_module

    prompt, budget = random_prompt(150), 36
    gathers, selections = [], []
    take_slots, top_slots = layer_module.take_slots, cache_module.top_slots
    monkeypatch.setattr(layer_module, "take_slots", lambda *args: gathers.append(1) or take_slots(*args))
    monkeypatch.setattr(cache_module, "top_slots", lambda *args: selections.append(1) or top_slots(*args))
    per_head = cache_module.kept_per_head

    def kept_per_head(*args, **kwargs):
        kept = per_head(*args, **kwargs)
        selections.extend([1] * (kept is not None))  # a head-wise selection
        return kept

    monkeypatch.setattr(cache_module, "kept_per_head", kept_per_head)
    keep, stages = layer_module.EvictionLayer.keep, CascadeStages.__init__
    pack, init = layer_module.EvictionLayer.keep_per_head, EvictionCache.__init__

    def unmerged(cache: EvictionCache) -> None:
        cache.merging = False

    def per_stage(stages: CascadeStages) -> None:
        stages.records = False

    runs, reads = {}, {}
    for mode in ("recorded", "per_stage", "eager"):
        if mode == "per_stage":  # every stage evicts the layers over their budgets
            monkeypatch.setattr(CascadeStages, "__init__", lambda self, cache: stages(self, cache) or per_stage(self))
        if mode == "eager":  # every eviction gathers (and packs, head-wise) at once, unpacked by the next stage, and
            # hands the attending modifiers what it drops
            monkeypatch.setattr(EvictionCache, "__init__", lambda self, *a, **k: init(self, *a, **k) or unmerged(self))
            monkeypatch.setattr(
                layer_module.EvictionLayer, "keep", lambda self, kept, defer=False, **more: keep(self, kept, **more)
            )
            monkeypatch.setattr(
                layer_module.EvictionLayer,
                "keep_per_head",
                lambda self, kept, ranking, defer=False, counts=None: pack(self, kept, ranking),
            )
        gathers.clear(), selections.clear()
        settings = {name: value for name, value in {"window": 8, **params}.items() if value is not None}
        engine = Engine(llama, build_policy(spec, settings), budget)
        cache = engine.new_cache(len(prompt))
        with Operators() as counted:
            engine.prefill(cache, prompt)
        reads[mode] = counted.host_reads
        runs[mode] = (cache, len(gathers), len(selections), engine.generate(random_prompt(150), 6))
    (recorded_cache, *counts, output), reference = runs["recorded"], runs["eager"]
    # each stage's preference read at its layer, or all at once by one .tolist() (which a CPU does not count); a
    # head-wise layer reads its heads' lengths as it packs: once a layer recorded, at every stage else
    headwise = spec == "cake+adakv"
    assert reads["per_stage"] - reads["recorded"] >= (len(llama.model.layers) if recorded else 0)
    assert (reads["recorded"] == 0 or headwise or not recorded) and (reads["per_stage"] > reads["recorded"]) == recorded
    assert (counts[1] < runs["per_stage"][2]) == recorded  # selections
    assert counts[0] <= runs["per_stage"][1]
    assert (runs["per_stage"][1] < reference[1]) == (not headwise)  # head-wise layers pack what they keep
    for cache in (recorded_cache, runs["per_stage"][0]):
        assert cache.peak_bytes == reference[0].peak_bytes and cache.live_bytes == reference[0].live_bytes
        assert cache.policy_stats() == reference[0].policy_stats()  # each layer's preference among them
        assert cache.kept_by_head() == reference[0].kept_by_head()
        for a, b in zip(cache.eviction_layers, reference[0].eviction_layers):
            assert a.deferred_slots is None and a.deferred_heads is None
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            if a.headwise is not None:  # packed once the cascade ends, or at every stage and laid out again
                assert b.headwise is not None
                for name in ("keys", "values", "positions", "ranking", "lengths", "slots"):
                    assert torch.equal(getattr(a.headwise, name), getattr(b.headwise, name)), name
            assert a.modifier_state.keys() == b.modifier_state.keys()
            if "slake" in a.modifier_state:  # L, k_sum, v_sum, ℓ of the evicted entries
                ours, theirs = vars(a.modifier_state["slake"].linear), vars(b.modifier_state["slake"].linear)
                for name, tensor in ours.items():
                    torch.testing.assert_close(tensor, theirs[name], rtol=1e-5, atol=1e-5)
            if "calidrop" in a.modifier_state:  # its store (in another order), C_q, and C_lse/C_out over the store
                ours, theirs = a.modifier_state["calidrop"], b.modifier_state["calidrop"]
                assert torch.equal(ours.query, theirs.query)
                assert torch.equal(ours.store.positions.sort().values, theirs.store.positions.sort().values)
                torch.testing.assert_close(ours.lse, theirs.lse, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ours.out, theirs.out, rtol=1e-5, atol=1e-5)
    assert output.token_ids == reference[3].token_ids and output.kv == reference[3].kv


@pytest.mark.parametrize("spec,params,reads", [("cake", {}, False), ("snapkv", {"layer_budget": VABS}, True)])
@torch.inference_mode()
def test_a_stage_finds_the_slots_the_average_budget_evicts_only_for_a_preference_that_reads_them(
    llama, spec, params, reads, monkeypatch
):
    """CAKE's preference reads the window's attention alone: its stages do not select what the average budget would
    evict (a top-k, a sort and a scatter a layer); VABS's read them at every stage."""
    asked = []
    evicted_by = CascadeStages.evicted_by
    monkeypatch.setattr(CascadeStages, "evicted_by", lambda self, *args: asked.append(1) or evicted_by(self, *args))
    engine = Engine(llama, build_policy(spec, params), 36)
    engine.generate(random_prompt(150), 2)
    assert len(asked) == (len(llama.model.layers) if reads else 0)
