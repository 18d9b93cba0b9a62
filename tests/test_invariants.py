"""The engine's invariants for every policy the registry knows: each base alone and with each modifier.

A policy added as one file in ``kvbench/policies/`` is covered here without editing a test:

* a budget covering the prompt runs the full cache, one token short of it the policy (which then decodes from exactly
  what it kept);
* one-shot eviction really shrinks the cache tensors to the per-layer budgets, whose total is conserved;
* in the chunked regime a layer's live cache never exceeds its budget + block;
* the token decoded after eviction sees exactly the kept entries: its logits equal a full forward whose last
  query is masked, per layer and cache head, to the kept positions (attending modifiers, which replace decode
  attention by design, are checked to differ from it instead), on every tiny architecture.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.check import pruned_channels
from kvbench.engine import Engine
from kvbench.policies import build_policy
from kvbench.policies.methods.full import Full
from kvbench.policies.registry import BASES
from tests.helpers import (
    ARCHITECTURES,
    TOKENIZER,
    VARIANTS,
    kept_masks,
    masked_forward,
    query_agnostic,
    random_prompt,
    registry_policy,
    tiny_model,
)

SPECS = [spec for spec in VARIANTS if spec != "full"]  # every registered variant but the full cache
#: those that evict (Quest keeps the cache whole and reads part of it: tests/test_quest.py)
EVICTING = [spec for spec in SPECS if BASES[spec.split("+")[0]].evicts]
REGIMES = ["oneshot", "chunked", "streaming"]
LAYERS, BLOCK = 3, 16


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", layers=LAYERS)


def policy(spec: str):
    """The spec with its defaults, window 8, and its per-model settings for a model no paper tuned
    (:func:`~tests.helpers.registry_policy`)."""
    return registry_policy(spec, {"window": 8} if "window" in build_policy(spec).settings() else {})


def whole_chunks(policy) -> int:
    """How far a layer may keep from its budget: a policy that keeps whole chunks (``keeps_ranked_only``: ChunkKV)
    keeps fewer, or up to a chunk more; 0 for every other (it keeps exactly its budget)."""
    return max((getattr(m, "chunk_length", 0) for m in policy.modifiers if m.keeps_ranked_only), default=0)


def runner(model, spec: str, budget: int, regime: str = "oneshot") -> Engine:
    return Engine(model, policy(spec), budget, regime=regime, block_size=BLOCK, tokenizer=TOKENIZER)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("spec", SPECS)
def test_a_budget_covering_the_prompt_runs_the_full_cache_and_one_short_runs_the_policy(llama, spec, regime):
    """The engine's short-circuit: at a budget of the prompt's length or more the cache is the full cache (every
    policy then generates what ``full`` generates, :func:`test_the_short_circuit_generates_what_the_full_cache_does`);
    one token short of it, the policy itself."""
    engine = runner(llama, spec, 90, regime)
    context = query_agnostic(engine.policy, regime)
    assert isinstance(engine.new_cache(90, context).policy, Full)
    assert isinstance(runner(llama, spec, 4096, regime).new_cache(90, context).policy, Full)
    assert runner(llama, spec, 89, regime).new_cache(90, context).policy.spec == spec


@pytest.mark.parametrize("length", [1, 20])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("spec", SPECS)
def test_a_cache_that_grows_before_it_evicts_decodes_as_the_full_cache(llama, spec, regime, length):
    """A budget above the prompt (and a one-token prompt): the cache grows before any eviction, in every regime the
    policy is defined in, decoded as a run decodes (:func:`~kvbench.engine.rows.finished_rows`, a generator whose
    caller is not under inference mode); the tokens equal the full cache's. Then a budget the generation crosses:
    the cache grows, then evicts, and the run finishes."""
    from kvbench.engine.rows import finished_rows

    prompt = random_prompt(length, seed=length)
    engine = runner(llama, spec, 4096, regime)
    question = max(length // 2, 1) if query_agnostic(engine.policy, regime) else None

    def tokens(engine: Engine, new_tokens: int) -> list[int]:
        (_, output), *_ = finished_rows([engine.prefilled_row(prompt, new_tokens, question_start=question)], 1)
        return output.token_ids

    full = runner(llama, "full", 4096, regime).generate(prompt, 12, question_start=question).token_ids
    assert tokens(engine, 12) == full
    assert len(tokens(runner(llama, spec, length + 4, regime), 12)) == 12


def test_the_short_circuit_generates_what_the_full_cache_does(llama):
    prompt = random_prompt(90)
    full = runner(llama, "full", 4096).generate(prompt, max_new_tokens=10)
    output = runner(llama, "snapkv+caote", 90).generate(prompt, max_new_tokens=10)
    assert output.token_ids == full.token_ids
    assert output.kv.after_prefill_tokens_per_layer == full.kv.after_prefill_tokens_per_layer


@pytest.mark.parametrize("spec", EVICTING)
def test_one_token_short_of_the_prompt_every_layer_evicts_and_decodes_from_what_it_kept(llama, spec):
    """At a budget one token short of the prompt the policy runs: the layers' total is conserved (budget × layers, so
    one entry evicted per head and layer on average), and the next token sees exactly the entries kept (the masked
    full forward; attending modifiers replace that attention by design)."""
    prompt = random_prompt(60)
    engine = runner(llama, spec, 59)
    cache = engine.new_cache(len(prompt), query_agnostic(engine.policy))
    token = int(engine.prefill(cache, prompt)[0, -1].argmax())
    kept = kept_masks(cache, len(prompt))
    if not whole_chunks(engine.policy):  # (whole chunks keep what they keep, checked against kvpress elsewhere)
        assert sum(cache.tokens_per_layer()) == 59 * LAYERS
        assert sum(int((~mask).sum()) for mask in kept) == LAYERS * cache.cache_heads  # one entry a head and layer
    if not any(modifier.attends for modifier in engine.policy.modifiers):
        step = engine.step(cache, [token], len(prompt), evict=False)[0, -1]
        model = tiny_model("llama", layers=LAYERS)
        expected = masked_forward(model, prompt + [token], kept, len(prompt), pruned_channels(cache))[-1]
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", EVICTING)
def test_oneshot_eviction_shrinks_the_tensors(llama, spec):
    prompt, budget = random_prompt(200), 48
    engine = runner(llama, spec, budget)
    cache = engine.new_cache(len(prompt), query_agnostic(engine.policy))
    engine.prefill(cache, prompt)
    budgets, chunk = cache.layer_budgets, whole_chunks(engine.policy)
    assert sum(budgets) == budget * LAYERS
    if chunk:  # whole chunks: at most a chunk past the layer's budget
        assert all(0 < held < layer + chunk for held, layer in zip(cache.tokens_per_layer(), budgets))
        budgets = cache.tokens_per_layer()
    assert cache.tokens_per_layer() == budgets
    heads = cache.cache_heads
    for layer, kept, by_head in zip(cache.eviction_layers, budgets, cache.kept_by_head()):
        assert sum(map(len, by_head)) == heads * kept  # a length per head (AdaKV) or not: the layer's total
        assert layer.held_bytes() == 2 * heads * kept * 16 * layer.keys.element_size()
        assert all(sorted(set(positions)) == positions for positions in by_head)
        if layer.headwise is None:
            assert layer.keys.shape == layer.values.shape == (1, heads, kept, 16)


@pytest.mark.parametrize("spec", EVICTING)
def test_chunked_cache_never_exceeds_budget_plus_block(llama, spec):
    engine = runner(llama, spec, 40, "chunked")
    query_agnostic(engine.policy, "chunked")  # skips a method not defined chunked
    output = engine.generate(random_prompt(150), max_new_tokens=8)
    budgets = output.kv.after_prefill_tokens_per_layer  # each layer's budget (pyramid, dynamic: per layer)
    chunk = whole_chunks(engine.policy)  # whole chunks: up to a chunk past the budget, or below it after prefill
    if chunk:
        budgets = [max(pair) for pair in zip(budgets, engine.new_cache(150).layer_budgets)]
    assert all(peak <= budget + BLOCK + chunk for peak, budget in zip(output.kv.peak_tokens_per_layer, budgets))
    assert sum(budgets) == 40 * LAYERS or chunk
    assert output.kv.peak_bytes < output.kv.full_bytes


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("spec", EVICTING)
def test_decode_after_eviction_sees_exactly_the_kept_entries(spec, architecture):
    model = tiny_model(architecture, layers=LAYERS)
    prompt, budget = random_prompt(60), 24
    engine = runner(model, spec, budget)
    if (refusal := engine.model_refusal(engine.policy)) is not None:
        pytest.skip(refusal)  # a budget shared across the layers, beside Gemma 3's sliding ones
    cache = engine.new_cache(len(prompt), query_agnostic(engine.policy))
    token = int(engine.prefill(cache, prompt)[0, -1].argmax())
    kept = kept_masks(cache, len(prompt))
    step = engine.step(cache, [token], len(prompt), evict=False)[0, -1]
    model = tiny_model(architecture, layers=LAYERS)
    expected = masked_forward(model, prompt + [token], kept, len(prompt), pruned_channels(cache))[-1]
    if any(modifier.attends for modifier in engine.policy.modifiers):
        assert not torch.allclose(step, expected, rtol=1e-4, atol=1e-4)  # it recovers evicted information
    else:
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_masked_reference_without_eviction_is_the_model(architecture):
    """The reference keeping every position is the plain causal forward (so its masking is what differs)."""
    model = tiny_model(architecture, layers=LAYERS)
    tokens = random_prompt(30)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, -1]
    everything = [torch.ones(2, 29, dtype=torch.bool)] * LAYERS
    torch.testing.assert_close(masked_forward(model, tokens, everything, 29)[-1], expected, rtol=1e-4, atol=1e-4)
