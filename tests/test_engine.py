"""The engine on tiny random models: correctness against HF, perplexity, regimes (the invariants every
policy must hold are in test_invariants.py)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from kvbench.errors import KVBenchError
from tests.helpers import ARCHITECTURES, GEMMA3_WINDOW, engine, random_prompt, tiny_model

REGIMES = ["oneshot", "chunked", "streaming"]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("regime", REGIMES)
def test_full_cache_equals_hf_generate(architecture, regime):
    """20 greedy tokens after a 120-token prompt (Gemma 3's and GPT-OSS's windows are 16 tokens)."""
    model = tiny_model(architecture)
    prompt = random_prompt(120)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :].tolist()
    output = engine(model, "full", 64, regime).generate(prompt, max_new_tokens=20)
    assert output.token_ids == expected


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_full_perplexity_matches_one_forward_on_every_architecture(architecture):
    """Each token's NLL through the engine's full cache (chunked: several forwards) equals one eager forward of the
    model (its sliding windows shorter than the text)."""
    model, stream = tiny_model(architecture), random_prompt(70)
    model.set_attn_implementation("eager")
    with torch.no_grad():  # the model's own attention (an engine sets kvbench's)
        logits = model(torch.tensor([stream])).logits[0, :-1]
    nlls = engine(model, "full", 4096, "chunked").perplexity(stream).nlls
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(stream[1:]), reduction="none")
    torch.testing.assert_close(torch.tensor(nlls), expected, rtol=1e-4, atol=1e-4)


def test_sliding_window_layers_are_held_as_the_model_holds_them():
    """Gemma 3 (a 16-token window on two of three layers) over a 120-token prompt: the full cache generates what
    ``model.generate`` generates in every regime, its sliding layers holding the window's last 15 tokens as the
    model's own cache does (the global layer every token); a policy evicts the global layer to its budget and never
    the sliding ones."""
    assert engine(tiny_model("gemma3")).windows == [GEMMA3_WINDOW, GEMMA3_WINDOW, None]
    model = tiny_model("gemma3")
    prompt = random_prompt(120)
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    expected = reference.sequences[0, len(prompt) :].tolist()
    held = [layer.keys.shape[2] for layer in reference.past_key_values.layers]
    assert held == [GEMMA3_WINDOW - 1, GEMMA3_WINDOW - 1, len(prompt) + 7]
    for regime in REGIMES:
        output = engine(model, "full", 4096, regime).generate(prompt, max_new_tokens=8)
        assert output.token_ids == expected, regime
        assert output.kv.after_prefill_tokens_per_layer == [GEMMA3_WINDOW - 1, GEMMA3_WINDOW - 1, len(prompt)]
        entry = 2 * 2 * 16 * 4  # a token's key and value: 2 KV heads of 16 float32s
        assert output.kv.full_bytes == entry * (2 * (GEMMA3_WINDOW - 1) + len(prompt) + 8)  # the model's own cache
        model_bytes = sum(layer.keys.numel() + layer.values.numel() for layer in reference.past_key_values.layers)
        assert output.kv.peak_bytes == 4 * model_bytes  # float32: the model's own cache, each sliding layer its window
    kept = engine(model, "snapkv", 48).generate(prompt, max_new_tokens=4).kv
    assert kept.after_prefill_tokens_per_layer == [GEMMA3_WINDOW - 1, GEMMA3_WINDOW - 1, 48]
    streamed = engine(model, "h2o", 48, "streaming").generate(prompt, max_new_tokens=4).kv
    assert streamed.peak_tokens_per_layer == [GEMMA3_WINDOW, GEMMA3_WINDOW, 49]  # a step's own token beside them


@pytest.mark.parametrize("spec", ["cake", "cake+slake"])
def test_a_budget_shared_across_layers_is_refused_beside_sliding_layers(spec):
    """A dynamic layer budget (CAKE's cascade, SLAKE's VABS over it) allocates each layer as the prefill passes it;
    beside layers held as the model holds them it is refused in one line naming the policy and the choices."""
    model = tiny_model("gemma3")
    runner = engine(model, spec, 48)
    refusal = r"shares the budget across every layer, and 2 of this model's 3 layers"
    with pytest.raises(KVBenchError, match=refusal) as error:
        runner.generate(random_prompt(120), max_new_tokens=2)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_learned_sinks_are_in_every_softmax_as_the_models(backend):
    """GPT-OSS adds a learned logit per head to each softmax's denominator (``s_aux``) and attends every other layer
    through a sliding window: over a 120-token prompt (a 16-token window) the full cache generates the model's own
    greedy tokens from forwards without a cache, in every regime and with either backend (SDPA rescales its output by
    each query's log-sum-exp); without the sinks the model would answer otherwise. An attending modifier (its own
    attention of the kept entries, without the sinks) is refused in one line."""
    model, prompt = tiny_model("gpt_oss"), random_prompt(120)
    sinks = [module.sinks for module in model.modules() if hasattr(module, "sinks")]
    tokens = list(prompt)
    with torch.no_grad():
        for sink in sinks:  # far from their initial zeros, each head its own
            sink.copy_(torch.linspace(-2.0, 3.0, sink.numel()))
        for _ in range(8):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        with_sinks = model(torch.tensor([prompt])).logits[0, -1]
        saved = [sink.clone() for sink in sinks]
        for sink in sinks:  # at -inf: a plain softmax
            sink.fill_(-1e4)
        without = model(torch.tensor([prompt])).logits[0, -1]
        for sink, value in zip(sinks, saved):
            sink.copy_(value)
    assert not torch.allclose(with_sinks, without, atol=1e-2)
    for regime in REGIMES:
        runner = engine(model, "full", 4096, regime)
        runner.attn_backend = backend
        output = runner.generate(prompt, max_new_tokens=8)
        assert output.token_ids == tokens[len(prompt) :], regime
        assert output.kv.after_prefill_tokens_per_layer == [GEMMA3_WINDOW - 1, len(prompt), GEMMA3_WINDOW - 1]
    with torch.no_grad():  # the model's own cache after the prompt: a sliding layer after the global one included
        held = model(torch.tensor([prompt]), use_cache=True).past_key_values.layers
    peak = engine(model, "full", 4096).generate(prompt, max_new_tokens=1).kv.peak_bytes
    assert peak == 4 * sum(layer.keys.numel() + layer.values.numel() for layer in held) == 2 * 2 * 16 * 4 * (120 + 30)
    with pytest.raises(KVBenchError, match=r"calidrop replaces decode attention .* learned attention sinks") as error:
        engine(model, "snapkv+calidrop", 48).generate(prompt, max_new_tokens=2)
    assert "\n" not in str(error.value)


def test_streaming_peak_is_budget_plus_one(llama):
    output = engine(llama, "h2o", 32, "streaming").generate(random_prompt(80), max_new_tokens=5)
    assert output.kv.peak_tokens_per_layer == [33] * 3


@pytest.mark.parametrize("regime", REGIMES)
def test_full_perplexity_matches_one_forward(llama, regime):
    stream = random_prompt(70)
    nlls = engine(llama, "full", 4096, regime).perplexity(stream).nlls
    with torch.no_grad():
        logits = llama(torch.tensor([stream])).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(stream[1:]), reduction="none")
    assert len(nlls) == len(stream) - 1
    torch.testing.assert_close(torch.tensor(nlls), expected, rtol=1e-4, atol=1e-4)


def test_perplexity_budget_covering_stream_equals_full(llama):
    stream = random_prompt(60)
    full = engine(llama, "full", 4096, "streaming").perplexity(stream).nlls
    assert engine(llama, "h2o", 60, "streaming").perplexity(stream).nlls == full
    evicted = engine(llama, "h2o", 16, "streaming").perplexity(stream)
    # H2O attends blockwise from the weights it sums, not through SDPA: equal up to float32 rounding
    torch.testing.assert_close(torch.tensor(evicted.nlls[:15]), torch.tensor(full[:15]), rtol=1e-5, atol=1e-5)
    assert (torch.tensor(evicted.nlls) - torch.tensor(full)).abs().max() > 1e-3
    assert evicted.kv.peak_tokens_per_layer == [17] * 3


def test_stop_tokens_end_generation(llama):
    prompt = random_prompt(30)
    free = engine(llama).generate(prompt, max_new_tokens=6).token_ids
    stopped = engine(llama).generate(prompt, max_new_tokens=6, stop_token_ids=[free[2]]).token_ids
    assert stopped == free[: free.index(free[2])]


def test_unknown_regime_is_one_line_error(llama):
    with pytest.raises(
        KVBenchError, match=r"unknown engine.regime 'batched'; valid choices: chunked, oneshot, streaming"
    ):
        engine(llama, regime="batched")


def test_gqa_repeat_layout_stores_query_heads(llama):
    runner = engine(llama, "snapkv", 32, "oneshot", gqa="repeat", window=8)
    cache = runner.new_cache(100)
    runner.prefill(cache, random_prompt(100))
    assert cache.layers[0].keys.shape == (1, 4, 32, 16)


def test_attention_function_takes_transformers_positional_order():
    """Wrappers of registered attention functions (kvpress) pass ``dropout`` positionally, before ``scaling``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvbench.engine.attention import kvbench_attention

    def leading(function):
        return list(inspect.signature(function).parameters)[:7]

    assert leading(kvbench_attention) == leading(sdpa_attention_forward)


def test_take_slots_is_gather_along_the_slots():
    """``take_slots``: the rows ``gather`` takes along the slots, from contiguous entries and from a layer's view into
    storage with room to spare (:func:`~kvbench.engine.layer.appended`), both by one index."""
    from kvbench.engine.layer import appended
    from kvbench.policies.context import take_slots

    torch.manual_seed(0)
    entries = torch.randn(2, 3, 40, 8)
    grown = appended(entries[:, :, :39].clone(), entries[:, :, 39:])  # a view with APPEND_SPARE slots of room
    index = torch.rand(2, 3, 40).argsort(dim=-1)[..., :17].sort(dim=-1).values  # [B,H,K]
    expected = entries.gather(2, index[..., None].expand(-1, -1, -1, 8))
    assert all(torch.equal(taken, expected) for taken in take_slots(index, entries, grown))  # one index, both taken


def test_openmp_threads_sleep_after_a_short_spin_unless_the_environment_says_otherwise():
    """The CLI sets GNU OpenMP's wait before torch loads it (kvbench/engine/threads.py); a value given wins; importing
    kvbench sets nothing (a Python program calls ``kvbench.process.prepare``)."""
    show = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    started = "import kvbench.cli; " + show  # the CLI's module, which a sweep's job processes import too
    environment = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def printed(code: str, **given: str) -> list[str]:
        ran = subprocess.run([sys.executable, "-c", code], env={**environment, **given}, capture_output=True, text=True)
        return ran.stdout.split()[-2:]

    assert printed(started) == ["PASSIVE", "1000"] and printed(started, GOMP_SPINCOUNT="0") == ["PASSIVE", "0"]
    assert printed("import kvbench, kvbench.engine; " + show) == ["None", "None"]


@pytest.mark.model
def test_on_smollm2_a_streaming_cache_that_grows_before_it_evicts_runs_as_the_full_cache(tmp_path):
    """The bar that caught the regression: ``kvbench run`` on SmolLM2, RULER, ``engine.regime=streaming`` at a budget
    above the prompt (the cache grows, token by token, before any eviction): sink, h2o and tova write what the full
    cache writes (16 new tokens: SmolLM2's NIAH answers end by the 9th, conf/experiment/leaderboard.yaml)."""
    import json

    from kvbench.cli import main

    args = ["run", "model=smollm2_135m", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=256",
            "task.num_samples=1", "task.tokens_to_generate=16", "budget=100000", "engine.regime=streaming"]  # fmt: skip
    predictions = {}
    for policy in ("full", "sink", "h2o", "tova"):
        out = tmp_path / policy
        main([*args, f"policy={policy}", f"output_dir={out}"])
        predictions[policy] = json.loads((out / "predictions.jsonl").read_text())["prediction"]
    assert predictions["full"] and set(predictions.values()) == {predictions["full"]}
