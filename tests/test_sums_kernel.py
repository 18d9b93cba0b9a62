"""The fused running sums (kvbench/kernels/sums.py): exact against brute force and the engine's PyTorch pass, on CPU
under Triton's interpreter (tests/conftest.py), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvbench import kernels
from kvbench.errors import KVBenchError
from kvbench.kernels import sums
from kvbench.policies.scores import OBCACHE_TERMS, obcache
from tests.helpers import TOKENIZER, assert_shared_gives_each_alone, random_prompt, tiny_model

pytestmark = [pytest.mark.kernel, pytest.mark.skipif(not kernels.available(), reason="triton is not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = {"weights": None, **OBCACHE_TERMS}


def brute_force(queries, keys, values, scaling):
    """Every statistic from the full float32 attention matrix: outputs, lse, and each kind's sums ``[B,Hc,T]``."""
    batch, q_heads, q_len, _ = queries.shape
    heads, kv_len = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (keys, values))
    logits = torch.einsum("bhqd,bhtd->bhqt", queries.float(), keys) * scaling
    seen = torch.arange(kv_len) <= kv_len - q_len + torch.arange(q_len)[:, None]  # bottom-right causal
    logits = logits.masked_fill(~seen.to(logits.device), float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    outputs = weights @ values
    scores = obcache(weights, logits, outputs, values)

    def by_cache_head(per_query_head):
        return per_query_head.view(batch, heads, group, kv_len).sum(dim=2)

    sums_by_kind = {"weights": by_cache_head(weights.sum(dim=-2))}
    sums_by_kind.update({kind: by_cache_head(getattr(scores, kind)) for kind in OBCACHE_TERMS})
    return outputs, torch.logsumexp(logits, dim=-1), sums_by_kind


SHAPES = [  # batch, cache heads, group, queries, keys, head dim: decode, prefill, chunked, GQA, odd lengths, tile edges
    (1, 1, 1, 1, 37, 16),
    (1, 2, 3, 20, 20, 24),
    (2, 1, 2, 33, 70, 64),
    (1, 2, 1, 5, 130, 32),
    (1, 1, 4, 64, 64, 16),
    (1, 1, 1, 17, 80, 8),
]


#: every tile shape the GPU's tuning may pick, and small ones
TILES = sorted(
    {
        (16, 16),
        (16, 32),
        *(
            (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
            for c in getattr(sums, "CONFIGS", []) + getattr(sums, "ERROR_CONFIGS", [])
        ),
    }
)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("tiles", TILES, ids=lambda tiles: "x".join(map(str, tiles)))
def test_each_sum_equals_brute_force(shape, tiles):
    batch, heads, group, q_len, kv_len, dim = shape
    generator = torch.Generator().manual_seed(sum(shape))
    queries = torch.randn(batch, heads * group, q_len, dim, generator=generator) * 1.5
    keys, values = (torch.randn(batch, heads, kv_len, dim, generator=generator) for _ in range(2))
    queries, keys, values = (x.to(DEVICE) for x in (queries, keys, values))
    scaling = dim**-0.5
    outputs, lse, expected = brute_force(queries, keys, values, scaling)
    for kind, terms in KINDS.items():
        got = sums.attention_sums(queries, keys, values, outputs, lse, scaling, terms, tiles)
        assert got.shape == (batch, heads, kv_len) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected[kind], rtol=2e-5, atol=2e-5 * float(expected[kind].abs().max()))


def test_non_contiguous_keys_and_16_bit_inputs():
    """Keys and values as a cache holds them (a view of a longer buffer), and bfloat16 inputs: the logits from the
    16-bit products with float32 accumulation, as the PyTorch pass computes them on a GPU."""
    generator = torch.Generator().manual_seed(3)
    buffer = torch.randn(1, 2, 90, 32, generator=generator).to(DEVICE)
    keys, values = buffer[:, :, :50], buffer[:, :, 40:]  # [1,2,50,32] views, one not at the buffer's start
    queries = torch.randn(1, 4, 12, 32, generator=generator).to(DEVICE)
    outputs, lse, expected = brute_force(queries, keys, values, 0.2)
    got = sums.attention_sums(queries, keys, values, outputs, lse, 0.2, OBCACHE_TERMS["joint"], (16, 16))
    torch.testing.assert_close(got, expected["joint"], rtol=2e-5, atol=2e-5 * float(expected["joint"].abs().max()))
    half = [x.to(torch.bfloat16) for x in (queries, keys, values)]
    outputs, lse, expected = brute_force(*half, 0.2)
    got = sums.attention_sums(*half, outputs, lse, 0.2, None, (16, 16))
    torch.testing.assert_close(got, expected["weights"], rtol=1e-3, atol=1e-3 * float(expected["weights"].max()))


SPECS = ["h2o", "h2o+obcache_value", "h2o+obcache_key", "h2o+obcache_joint", "h2o+caote"]


@pytest.mark.parametrize("regime", ["oneshot", "chunked"])
def test_the_engine_keeps_the_same_tokens_with_the_fused_pass(regime, monkeypatch):
    """``engine.sums_kernel=triton`` against ``torch`` through the engine on a tiny GQA model: every layer's running
    scores equal within float32 rounding and the same slots kept, for H2O alone and with each re-weighting modifier
    (CAOTE, which has no fused form, sums its blocks as before). Each query's log-sum-exp is one fused call a layer
    and forward: the attention's own where it is one call (the whole causal square: oneshot, a chunked prompt's first
    block), a second beside the backend's where a block attends earlier slots too."""
    from kvbench.engine import Engine, attention
    from kvbench.policies import build_policy

    calls, backend = [], []  # the fused calls with log-sum-exps, the backend's attention calls
    with_lse, by_backend = attention.attention_with_lse, attention.backend_attention
    monkeypatch.setattr(attention, "attention_with_lse", lambda *args: calls.append(args[0].shape) or with_lse(*args))
    monkeypatch.setattr(attention, "backend_attention", lambda *args: backend.append(1) or by_backend(*args))
    model = tiny_model().to(DEVICE)
    prompt = random_prompt(150)
    layers = model.config.num_hidden_layers
    for spec in SPECS:
        caches = []
        for kernel in ("torch", "triton"):
            calls.clear(), backend.clear()
            runner = Engine(
                model, build_policy(spec, {}), 48, regime=regime, block_size=32, tokenizer=TOKENIZER, sums_kernel=kernel
            )
            cache = runner.new_cache(len(prompt))
            runner.prefill(cache, prompt)
            caches.append(cache)
        forwards = 1 if regime == "oneshot" else -(-len(prompt) // 32)
        assert len(calls) == forwards * layers, spec  # the triton run's: one a layer and forward
        assert len(backend) == (forwards - 1) * layers, spec  # the whole square's output from the fused call
        for reference, fused in zip(caches[0].eviction_layers, caches[1].eviction_layers):
            torch.testing.assert_close(fused.positions, reference.positions, msg=spec)
            scale = float(reference.running_score.abs().max())
            torch.testing.assert_close(fused.running_score, reference.running_score, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("architecture", ["gemma3", "gpt_oss", "qwen3"])
def test_the_fused_pass_keeps_the_same_tokens_beside_sliding_layers_and_learned_sinks(architecture, monkeypatch):
    """The fused pass against the blocks on Gemma 3 (sliding layers held, never scored), GPT-OSS (learned sinks: the
    scores read attention over the keys alone) and Qwen3 (QK-norm): the same slots kept at every scored layer."""
    import kvbench.policies.base as base
    from kvbench.engine import Engine
    from kvbench.policies import build_policy

    fused_calls = []
    monkeypatch.setattr(
        base, "attention_sums", lambda *args, **kw: fused_calls.append(1) or sums.attention_sums(*args, **kw)
    )

    model, prompt = tiny_model(architecture).to(DEVICE), random_prompt(90)
    for spec in ("h2o", "h2o+obcache_joint", "h2o+caote"):
        caches = []
        for kernel in ("torch", "triton"):
            runner = Engine(model, build_policy(spec, {}), 40, tokenizer=TOKENIZER, sums_kernel=kernel)
            caches.append(runner.new_cache(len(prompt)))
            runner.prefill(caches[-1], prompt)
            assert bool(fused_calls) == (kernel == "triton"), spec
            fused_calls.clear()
        scored = [
            pair for pair in zip(*(cache.eviction_layers for cache in caches)) if pair[0].running_score is not None
        ]
        assert scored, spec
        for reference, fused in scored:
            torch.testing.assert_close(fused.positions, reference.positions, msg=spec)
            scale = float(reference.running_score.abs().max())
            torch.testing.assert_close(fused.running_score, reference.running_score, rtol=1e-4, atol=1e-5 * scale)


def test_a_shared_prefill_and_rows_with_the_fused_pass_give_what_each_gives_alone():
    """The grid engine with ``engine.sums_kernel=triton``: variants of one prompt (H2O and OBCache over it at two
    budgets, SnapKV beside them) prefilled by one shared forward — whose attention gives the log-sum-exps once for
    all — and decoded as rows, each as its own ``generate``."""
    from kvbench.engine import Engine
    from kvbench.policies import build_policy

    model = tiny_model().to(DEVICE)
    runners = [
        Engine(model, build_policy(spec, {}), budget, tokenizer=TOKENIZER, sums_kernel="triton", record_kept=True)
        for spec in ("h2o", "h2o+obcache_joint", "h2o+obcache_value", "snapkv")
        for budget in (40, 64)
    ]
    assert_shared_gives_each_alone(runners, random_prompt(120), 6, batch_size=4)


def test_the_fused_pass_needs_a_gpu_or_the_interpreter(monkeypatch):
    from kvbench.engine import Engine
    from kvbench.policies import build_policy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device runs the kernel")
    with pytest.raises(KVBenchError, match=r"^engine.sums_kernel=triton runs on a CUDA device \(here cpu\)"):
        Engine(tiny_model(), build_policy("h2o", {}), 48, sums_kernel="triton")
    with pytest.raises(KVBenchError, match=r"^unknown engine.sums_kernel .fast.; valid choices: auto, torch, triton"):
        Engine(tiny_model(), build_policy("h2o", {}), 48, sums_kernel="fast")


def test_auto_takes_the_fused_pass_on_a_gpu_and_names_the_run_as_torch():
    """``engine.sums_kernel=auto`` (the default): the fused pass on a CUDA device where triton is installed, the
    blocks on a CPU (under the interpreter too); a run of ``auto`` is named as one of ``torch`` (the name every run
    had before the setting), one of ``triton`` otherwise."""
    from kvbench.config import compose
    from kvbench.engine import Engine
    from kvbench.engine.runner import sums_kernel_on
    from kvbench.policies import build_policy
    from kvbench.rundir import run_name

    assert sums_kernel_on(torch.device("cuda")) == "triton" and sums_kernel_on(torch.device("cpu")) == "torch"
    assert sums_kernel_on(torch.device("cpu"), "triton") == "triton"
    engine = Engine(tiny_model().to(DEVICE), build_policy("h2o", {}), 48)
    assert engine.sums_kernel == ("triton" if DEVICE == "cuda" else "torch")
    names = {
        kernel: run_name(_root_=compose(["model=tiny_llama", "policy=h2o", f"engine.sums_kernel={kernel}"]))
        for kernel in ("auto", "torch", "triton")
    }
    assert compose([]).engine.sums_kernel == "auto"
    assert names["auto"] == names["torch"] != names["triton"]
