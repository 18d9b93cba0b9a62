"""The engine on CUDA with SDPA in bfloat16 (skipped without a GPU; run on one with ``pytest -m cuda``).

The CPU suite proves the math in float32; these tests check that the same engine keeps its promises where
the papers run: tensors stay on the device and really shrink, no eviction equals full attention, scores in
bfloat16 keep nearly the float32 token sets, and the benchmark times with CUDA events.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kvbench.cli import main
from tests.helpers import engine, generated_shared, question_start, random_prompt, registry_engines, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

POLICIES = ["sink", "h2o", "tova", "snapkv", "pyramidkv", "snapkv+caote", "snapkv+obcache_joint", "h2o+obcache_joint"]


@pytest.fixture(scope="module")
def cuda_model():
    return tiny_model("llama").to("cuda", torch.bfloat16)


def kept_positions(model, spec: str, prompt: list[int], budget: int) -> list[set[tuple[int, int, int]]]:
    """Per layer, the set of kept ``(batch, head, position)`` after a oneshot prefill."""
    runner = engine(model, spec, budget)
    cache = runner.new_cache(len(prompt))
    with torch.inference_mode():
        runner.prefill(cache, prompt)
    return [
        {
            (batch, head, position)
            for batch, rows in enumerate(layer.positions.tolist())
            for head, positions in enumerate(rows)
            for position in positions
        }
        for layer in cache.layers
    ]


def test_full_cache_equals_hf_generate_in_bf16(cuda_model):
    prompt = random_prompt(120)
    ids = torch.tensor([prompt], device="cuda")
    expected = cuda_model.generate(ids, max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert engine(cuda_model, "full", 64).generate(prompt, max_new_tokens=12).token_ids == expected


@pytest.mark.parametrize("regime", ["oneshot", "chunked", "streaming"])
def test_full_perplexity_matches_one_forward_in_bf16(cuda_model, regime):
    """Blocks of 16 or single tokens sum in another order than one forward: equal up to bf16 rounding."""
    stream = random_prompt(70)
    nlls = engine(cuda_model, "full", 4096, regime).perplexity(stream).nlls
    with torch.no_grad():
        logits = cuda_model(torch.tensor([stream], device="cuda")).logits[0, :-1].float()
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(stream[1:], device="cuda"), reduction="none")
    torch.testing.assert_close(torch.tensor(nlls), expected.cpu(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("spec", POLICIES)
def test_budget_at_least_prompt_equals_full_in_bf16(cuda_model, spec):
    prompt = random_prompt(90)
    full = engine(cuda_model, "full", 4096).generate(prompt, max_new_tokens=10)
    policy = engine(cuda_model, spec, 90).generate(prompt, max_new_tokens=10)
    assert policy.token_ids == full.token_ids
    assert policy.kv.after_prefill_tokens_per_layer == [90] * 3


@pytest.mark.parametrize("spec", POLICIES)
def test_cache_shrinks_on_the_device(cuda_model, spec):
    prompt = random_prompt(200)
    runner = engine(cuda_model, spec, 48)
    cache = runner.new_cache(len(prompt))
    runner.prefill(cache, prompt)
    for layer, budget in zip(cache.layers, cache.layer_budgets):
        assert layer.keys.device.type == "cuda" and layer.keys.dtype == torch.bfloat16
        assert layer.keys.shape == (1, 2, budget, 16) and layer.values.shape == (1, 2, budget, 16)
        assert torch.all(layer.positions[..., 1:] > layer.positions[..., :-1])
    assert sum(cache.layer_budgets) == 48 * 3


@pytest.mark.parametrize(
    "spec", ["h2o", "tova", "snapkv", "snapkv+caote", "snapkv+obcache_value", "snapkv+obcache_key"]
)
def test_float32_on_cuda_keeps_the_cpu_tokens(spec):
    """Same weights, float32 on both devices (TF32 off): the kept token sets agree with the CPU's almost
    everywhere (summation order differs between devices, so an exact tie may break the other way)."""
    prompt = random_prompt(160)
    cpu = kept_positions(tiny_model("llama"), spec, prompt, 40)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        cuda = kept_positions(tiny_model("llama").to("cuda"), spec, prompt, 40)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    overlap = [len(mine & theirs) / len(mine | theirs) for mine, theirs in zip(cpu, cuda)]
    assert min(overlap) >= 0.97, overlap


@pytest.mark.parametrize("spec", ["h2o", "snapkv", "snapkv+caote", "snapkv+obcache_joint"])
def test_bf16_scores_keep_nearly_the_float32_tokens(cuda_model, spec):
    prompt = random_prompt(160)
    reference = kept_positions(tiny_model("llama").to("cuda"), spec, prompt, 40)
    bf16 = kept_positions(cuda_model, spec, prompt, 40)
    overlap = [len(mine & theirs) / len(mine | theirs) for mine, theirs in zip(reference, bf16)]
    assert sum(overlap) / len(overlap) >= 0.85, overlap


def test_decode_after_eviction_matches_masked_full_attention_in_bf16(cuda_model):
    """As the CPU test: after StreamingLLM eviction the next logits equal a forward that masks exactly the
    evicted positions, up to bf16 rounding, far closer than a forward that masks the wrong ones."""
    prompt, budget, sinks = random_prompt(60), 20, 4
    runner = engine(cuda_model, "sink", budget, n_sink=sinks)
    cache = runner.new_cache(len(prompt))
    logits = runner.prefill(cache, prompt)
    token = int(logits[0, -1].argmax())
    step_logits = runner.step(cache, [token], len(prompt), evict=False)[0, -1].float()

    reference = tiny_model("llama").to("cuda", torch.bfloat16)
    reference.set_attn_implementation("eager")
    length = len(prompt) + 1

    def masked_logits(kept: set[int]) -> torch.Tensor:
        mask = torch.full((length, length), float("-inf")).triu(1)
        mask[-1] = torch.tensor([0.0 if (p in kept or p == length - 1) else float("-inf") for p in range(length)])
        with torch.no_grad():
            ids = torch.tensor([prompt + [token]], device="cuda")
            return reference(ids, attention_mask=mask[None, None].to("cuda", torch.bfloat16)).logits[0, -1].float()

    expected = masked_logits(set(range(sinks)) | set(range(len(prompt) - (budget - sinks), len(prompt))))
    wrong = masked_logits(set(range(budget)))
    error = (step_logits - expected).abs().max()
    assert error <= 0.05 * expected.abs().max()
    assert error * 4 < (step_logits - wrong).abs().max()


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attention_2_full_cache_equals_sdpa():
    prompt = random_prompt(120)
    sdpa = tiny_model("llama").to("cuda", torch.bfloat16)
    flash = tiny_model("llama", attn_implementation="flash_attention_2").to("cuda", torch.bfloat16)
    expected = engine(sdpa, "snapkv", 48).generate(prompt, max_new_tokens=8).token_ids
    assert engine(flash, "snapkv", 48).generate(prompt, max_new_tokens=8).token_ids == expected


def test_bench_on_cuda_times_with_events_and_reports_cuda_memory(tmp_path):
    overrides = [
        "model=tiny_llama",
        "model.device=cuda",
        "model.dtype=bfloat16",
        "budget=64",
        "bench.repetitions=1",
        "bench.warmup_tokens=0",
        "bench.prompt_source=paragraph",
        "bench.prefill.policies=[snapkv]",
        "bench.prefill.prompt_lengths=[160]",
        "bench.decode.prompt_lengths=[96,160]",
        "bench.decode.new_tokens=3",
        "bench.memory.policies=[full,snapkv]",
        "bench.memory.prompt_lengths=[96,160]",
        "bench.memory.new_tokens=2",
        "bench.generate.prompt_lengths=[32]",
        "bench.generate.new_tokens=4",
        "bench.kvpress.enabled=false",
        "bench.headwise.policies=[]",
        "bench.grid.policies=[]",
        "bench.contexts.policies=[]",
    ]
    main(["bench", *overrides, f"output_dir={tmp_path}"])
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["machine"]["device"].startswith("cuda") and results["machine"]["dtype"] == "bfloat16"
    assert results["prefill_overhead"]["snapkv"]["160"] > 0
    assert results["raw"]["generate"]["same_tokens"] == {"32": True}
    rows = results["memory"]["policies"]
    assert all(row["cuda_peak_delta_bytes"] > 0 for by_length in rows.values() for row in by_length.values())
    assert rows["snapkv"]["160"]["peak_bytes"] < rows["full"]["160"]["peak_bytes"]
    assert "CUDA peak − before" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("rows_attention", ["each", "padded", "stored"])
def test_the_grid_engine_on_the_device_gives_each_variant_its_own_run_in_bf16(cuda_model, rows_attention):
    """The grouped paths on the GPU in bfloat16: the registry's variants at two budgets and both head layouts, the
    oneshot ones prefilled by one shared forward, the query-agnostic ones (KVzip) answering from a compressed
    context, all decoded 8 rows at a time (:func:`~tests.helpers.generated_shared`), each row attended alone,
    padded into one call per layer or held together (``engine.rows_attention``): each keeps its own run's cache
    sizes, and its tokens up to bfloat16 rounding (a batched matmul may round a logit another way than one row's:
    at least 95 % of all tokens and every variant's first token equal)."""
    prompt = random_prompt(160)
    cases = [(32, "oneshot", {}), (48, "oneshot", {"gqa": "repeat"}), (48, "chunked", {})]
    engines, _ = registry_engines(cuda_model, cases, len(prompt), block_size=64, rows_attention=rows_attention)
    alone = [engine.generate(prompt, 6, question_start=question_start(engine, prompt)) for engine in engines]
    shared = generated_shared(engines, prompt, 6, batch_size=8)
    pairs = list(zip(alone, shared, strict=True))
    assert all(one.kv.after_prefill_tokens_per_layer == other.kv.after_prefill_tokens_per_layer for one, other in pairs)
    assert all(one.token_ids[:1] == other.token_ids[:1] for one, other in pairs)
    same = sum(a == b for one, other in pairs for a, b in zip(one.token_ids, other.token_ids))
    assert same >= 0.95 * sum(len(one.token_ids) for one, _ in pairs)
