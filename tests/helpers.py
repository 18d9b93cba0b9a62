"""Small builders shared by the tests: tiny random models, prompts and engines over them."""

from __future__ import annotations

import base64
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvbench import PROJECT_ROOT
from kvbench.budgets import Budget
from kvbench.check import kept_masks, masked_forward  # noqa: F401  (the tests' references)
from kvbench.engine import Engine
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.policies import BASES, MODIFIERS, build_policy, composable
from kvbench.policies.base import Policy

#: the tiny models' tokenizer (byte ids below their vocabulary), for a policy that reads text (KVzip's requests)
TOKENIZER = byte_tokenizer(4096)

#: the tiny Gemma 3's sliding window: shorter than the tests' prompts, so that its local layers drop their oldest tokens
GEMMA3_WINDOW = 16
#: the tiny GPT-OSS: four experts, two per token, learned sinks, sliding layers (every other one) of Gemma 3's window
GPT_OSS = dict(head_dim=16, sliding_window=GEMMA3_WINDOW, num_local_experts=4, num_experts_per_tok=2)
GPT_OSS.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: the tiny architectures the registry's tests run every policy on, with what each needs beside the shared shapes:
#: Qwen3's QK-norm, Phi-3's fused projections (its padding id within the tiny vocabulary)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": GEMMA3_WINDOW}),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, GPT_OSS),
}


def refused(capsys, args: list[str], written: Path | None = None) -> str:
    """``kvbench ARGS`` (the command line, in this process) answering bad input: exit 2 and one line on stderr,
    ``kvbench: error: …`` naming the value and the valid choices, no traceback, and nothing written at ``written``
    (the path the command would have made). Returns that line."""
    from kvbench.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("kvbench: error: ") and error.count("\n") == 1, error
    assert written is None or not written.exists(), f"{written} was written"
    return error


def gemma3_layers(layers: int) -> list[str]:
    """The tiny Gemma 3's layer types: every third layer and the last global, the others sliding (two of three)."""
    glob = [layer % 3 == 2 or layer == layers - 1 for layer in range(layers)]
    return ["full_attention" if full else "sliding_attention" for full in glob]


def tiny_model(architecture: str = "llama", seed: int = 0, layers: int = 3, vocab: int = 300, **overrides):
    """A randomly initialised GQA model (4 query heads, 2 KV heads) with non-flat attention."""
    config_class, model_class, own = ARCHITECTURES[architecture]
    settings = dict(
        **own,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    if architecture == "gemma3":
        settings["layer_types"] = gemma3_layers(layers)
    settings.update(overrides)
    torch.manual_seed(seed)
    return model_class(config_class(**settings)).eval()


def random_prompt(length: int, vocab: int = 300, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def engine(model, spec="full", budget=64, regime="oneshot", **params) -> Engine:
    """An engine for ``spec`` (its parameters as keywords) with 16-token chunks."""
    return Engine(model, build_policy(spec, params), budget, regime=regime, block_size=16, tokenizer=TOKENIZER)


def query_agnostic(policy: Policy, regime: str = "oneshot") -> bool:
    """How the registry's tests run ``policy`` under ``regime``: on the whole prompt (False), or on a context whose
    question is read after it is compressed where the policy is defined only so (True: KVzip); skipped, with the
    policy's own reason, where it is not defined under ``regime`` at all."""
    if policy.refusal(regime, False) is None:
        return False
    refusal = policy.refusal(regime, True)
    if refusal is not None:
        pytest.skip(refusal)
    return True


def checked_evictions(verdict):
    """A watch (:attr:`EvictionCache.watch <kvbench.engine.cache.EvictionCache.watch>`) recording every eviction's
    ``verdict(layer_idx, keys, values, kept, budget)``: the layer's cache before it (``keys``/``values [Hc,T,D]``
    float64, row 0) and the slots it kept, a mask ``kept [Hc,T]``; and the list the verdicts are appended to."""
    evictions: list[bool] = []

    @contextmanager
    def watch(layer_idx, budget, scores, layer):
        keys, values, positions = layer.keys[0].double(), layer.values[0].double(), layer.positions[0].clone()
        yield
        kept = torch.stack([torch.isin(positions[h], layer.positions[0, h]) for h in range(positions.shape[0])])
        evictions.append(bool(verdict(layer_idx, keys, values, kept, budget)))

    return watch, evictions


#: every base alone and with every modifier that applies to it (a new policy is covered without editing a test)
VARIANTS = [spec for base in BASES for spec in [base, *(f"{base}+{m}" for m in MODIFIERS if composable(base, m))]]


#: the registry-wide tests over the seven architectures: every variant on the reference one (Llama); on the others
#: every base alone and, of the variants with modifiers, a half on each of the two with sliding-window layers (Gemma 3,
#: GPT-OSS) and a quarter on each dense GQA one, taken in turn over :data:`VARIANTS` (``(offset, every)``), so that
#: each variant runs on Llama, on one sliding-window architecture and on one dense one (3 runs of each, not 7)
ARCHITECTURE_SHARES = {
    "llama": (0, 1),
    "gemma3": (0, 2),
    "gpt_oss": (1, 2),
    "mistral": (0, 4),
    "phi3": (1, 4),
    "qwen2": (2, 4),
    "qwen3": (3, 4),
}


def architecture_variants(architecture: str) -> list[str]:
    """The registered variants the registry-wide tests run on ``architecture`` (:data:`ARCHITECTURE_SHARES`)."""
    offset, every = ARCHITECTURE_SHARES[architecture]
    return [spec for number, spec in enumerate(VARIANTS) if "+" not in spec or number % every == offset]


#: a base's settings in the registry's tests where its defaults keep whole layers or heads (the invariants ask every
#: layer and head to evict): SimLayerKV finds no layer lazy at 0.9 on a tiny random model, at 0 every one; DuoAttention
#: streams every head at 1 (tests/test_simlayerkv.py, tests/test_duo_attention.py: both ends, and between them)
REGISTRY_SETTINGS = {"simlayerkv": {"lazy_threshold": 0.0}, "duo_attention": {"streaming": 1.0, "n_sink": 4}}


def registry_policy(spec: str, params: dict | None = None) -> Policy:
    """``spec`` with ``params`` and its per-model settings for a model no paper tuned: the layer budget's fallbacks,
    or 0.5 where it has none (VABS's α/β exist only per model in SLAKE Table 3)."""
    from dataclasses import replace

    params = {**REGISTRY_SETTINGS.get(spec.split("+")[0], {}), **(params or {})}
    built = build_policy(spec, params)
    try:
        built.for_model(None, Budget.parse("64"))
    except KVBenchError:  # no fallback: the model's own settings, which a tiny model has none of
        missing = {name: 0.5 for name, value in built.layer_budget.parameters().items() if value is None}
        built.layer_budget = replace(built.layer_budget, **missing)
    return built


def registry_engines(
    model,
    cases: list[tuple[int, str, dict]],
    prompt_len: int,
    contexts: tuple[bool, ...] = (False, True),
    decode_evict: bool = False,
    variants: list[str] | None = None,
    **settings,
) -> tuple[list[Engine], list[str]]:
    """An :class:`Engine` (``settings``; the tiny models' tokenizer unless given; evicting while it decodes where
    ``decode_evict``) for every registered variant (:data:`VARIANTS`, or those of ``variants``) at each case
    ``(budget, regime, policy params)``, and the cases left out, each named with its reason: those the policy declares
    it does not define (its refusal under the regime for every one of ``contexts``, query-aware and query-agnostic,
    or evicting while it decodes; a budget its reserved window fills), decided before anything runs, so that no case
    vanishes by an error."""
    settings.setdefault("tokenizer", TOKENIZER)
    engines, left_out = [], []
    for spec in VARIANTS if variants is None else variants:
        for budget, regime, params in cases:
            policy = registry_policy(spec, params)
            refusals = [policy.refusal(regime, context, decode_evict) for context in contexts]
            refusal = refusals[0] if all(refusals) else policy.budget_refusal(budget, prompt_len)
            if not refusal:  # beside a model's sliding-window layers (Gemma 3's)
                engine = Engine(
                    model, policy, budget, regime, **settings, **({"decode_evict": True} if decode_evict else {})
                )
                refusal = engine.model_refusal(policy)
            if refusal:
                left_out.append(f"{spec}@{budget} {regime} {params}: {refusal}")
            else:
                engines.append(engine)
    return engines, left_out


def question_start(runner: Engine, prompt: list[int]) -> int | None:
    """Where the registry's tests start ``prompt``'s question for ``runner``: nowhere (None: the whole prompt at once)
    unless its policy runs only query-agnostically (KVzip): then its last eighth."""
    policy, regime = runner.policy, runner.regime
    agnostic = policy.refusal(regime, False) is not None and policy.refusal(regime, True) is None
    return len(prompt) - len(prompt) // 8 if agnostic else None


def generated_shared(runners: list[Engine], prompt: list[int], max_new_tokens: int, **settings) -> list:
    """:func:`~kvbench.engine.shared.generate_shared`'s outputs for ``runners`` in their order, those of one
    :func:`question_start` sharing one call."""
    from kvbench.engine.shared import generate_shared

    by_question: dict[int | None, list[int]] = {}
    for index, runner in enumerate(runners):
        by_question.setdefault(question_start(runner, prompt), []).append(index)
    outputs: list = [None] * len(runners)
    for question, indices in by_question.items():
        group = [runners[index] for index in indices]
        shared = generate_shared(group, prompt, max_new_tokens, question_start=question, **settings)
        for index, output in zip(indices, shared):
            outputs[index] = output
    return outputs


def generated_alone(runners: list[Engine], prompt: list[int], max_new_tokens: int) -> list:
    """Each runner's own :meth:`Engine.generate` of ``prompt`` (its question at :func:`question_start`)."""
    return [
        runner.generate(prompt, max_new_tokens, question_start=question_start(runner, prompt)) for runner in runners
    ]


def assert_each_as_alone(runners: list[Engine], alone: list, outputs: list) -> None:
    """The registry's comparison: each runner's output has the tokens, kept sets, cache sizes and policy statistics
    of its ``alone`` output (its own :meth:`Engine.generate`)."""
    for runner, one, other in zip(runners, alone, outputs, strict=True):
        label = f"{runner.policy.spec}@{runner.budget.spec} {runner.regime}"
        assert (other.token_ids, other.kept, other.kv, other.policy_stats) == (
            one.token_ids,
            one.kept,
            one.kv,
            one.policy_stats,
        ), label


def assert_shared_gives_each_alone(runners: list[Engine], prompt: list[int], max_new_tokens: int, **settings) -> list:
    """The registry's equivalence: each runner's output of :func:`generated_shared` (``settings``: ``batch_size``)
    is its own :meth:`Engine.generate`'s (:func:`assert_each_as_alone`); returns the shared outputs."""
    shared = generated_shared(runners, prompt, max_new_tokens, **settings)
    assert_each_as_alone(runners, generated_alone(runners, prompt, max_new_tokens), shared)
    return shared


def prefill_and_decode(runner: Engine, prompt: list[int], steps: int = 4, watch=None):
    """A cache for ``prompt`` prefilled by ``runner``, then ``steps`` tokens decoded (evicting where the regime does
    while decoding: chunked, streaming); ``watch``: observes its evictions (:func:`checked_evictions`)."""
    cache = runner.new_cache(len(prompt), query_agnostic(runner.policy, runner.regime))
    cache.watch = watch
    runner.prefill(cache, prompt)
    for step in range(steps):
        runner.step(cache, [7 + step], len(prompt) + step, evict=runner.decode_evict)
    return cache


def unpacked_mask(packed: str, heads: int, length: int) -> torch.Tensor:
    """A reference's kept positions of one layer, a bit mask packed per head and base64-encoded (the fixture
    scripts' format), as a mask ``[heads, length]``."""
    bits = np.unpackbits(np.frombuffer(base64.b64decode(packed), dtype=np.uint8).reshape(heads, -1), axis=-1)
    return torch.from_numpy(bits[:, :length].astype(bool))


def local_data(variable: str, *shared: str) -> Path:
    """Test data the user points to with the environment ``variable`` (as kvbench's task files read it), else
    the workplace's copy beside the project (``../shared/<shared...>``); callers skip when it is absent."""
    return Path(os.environ.get(variable) or PROJECT_ROOT.parent.joinpath("shared", *shared))


@contextmanager
def _recording(record):
    """Every ranking a cache's scorer makes while in the block, handed to ``record(scorer, layer_idx, ranking)``."""
    from unittest import mock

    from kvbench.engine.scoring import Scorer

    ranked = Scorer.shared_scores

    def recording(scorer, layer_idx, *args):
        ranking = ranked(scorer, layer_idx, *args)
        record(scorer, layer_idx, ranking)
        return ranking

    with mock.patch.object(Scorer, "shared_scores", recording):
        yield


@contextmanager
def recorded_rankings():
    """Each layer's rankings by its cache's scorer while in the block, oldest first: ``{layer: [(positions [Hc,T],
    ranking [Hc,T]), ...]}`` of the batch's first row (what :func:`assert_equal_up_to_near_ties` reads)."""
    rankings: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(scorer, layer_idx, ranking):
        positions = scorer.layers[layer_idx].positions[0].clone()
        rankings.setdefault(layer_idx, []).append((positions, ranking[0].float().clone()))

    with _recording(record):
        yield rankings


def assert_equal_up_to_near_ties(
    ours: torch.Tensor,
    theirs: torch.Tensor,
    rankings: list[tuple[torch.Tensor, torch.Tensor]],
    label: str,
    rtol: float = 1e-5,
) -> None:
    """The kept masks ``ours``/``theirs [Hc,T]`` equal but where the scores tie within float32 rounding: on each head a
    position kept by one side and not the other ranks, by its last ranking in ``rankings`` (a layer's from
    :func:`recorded_rankings`), within ``rtol`` of those that replace it (another CPU's matrix kernels round a
    reference's scores in the last bits, and break an exact or near tie their own way: a copy of a token in the first
    layer, say)."""
    for head in range(ours.shape[0]):
        only_ours, only_theirs = (ours[head] & ~theirs[head]).nonzero(), (theirs[head] & ~ours[head]).nonzero()
        assert len(only_ours) == len(only_theirs), f"{label} head {head}"
        if len(only_ours) == 0:
            continue
        differing = torch.cat([only_ours, only_theirs]).flatten()  # [2n]
        values = torch.full(differing.shape, torch.nan)
        for positions, ranking in rankings:  # oldest first: each position's last ranking
            match = positions[head][:, None] == differing  # [T,2n]
            found = match.any(0)
            values[found] = ranking[head][match.int().argmax(0)][found]
        assert bool(values.isfinite().all()), f"{label} head {head}: a differing position was never ranked"
        spread, scale = float(values.max() - values.min()), float(values.abs().max())
        assert spread <= rtol * scale, f"{label} head {head}: kept sets differ by {spread:.3g} at {scale:.3g}"


@contextmanager
def rankings_by_policy():
    """Every ranking the caches' scorers make while in the block, in order, by policy: ``{id(policy): [(layer,
    positions [B,Hc,T], ranking [B,Hc,T]), ...]}`` (what :func:`assert_diverged_at_a_near_tie` reads)."""
    rankings: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def record(scorer, layer_idx, ranking):
        made = layer_idx, scorer.layers[layer_idx].positions.clone(), ranking.float().clone()
        rankings.setdefault(id(scorer.policy), []).append(made)

    with _recording(record):
        yield rankings


def assert_diverged_at_a_near_tie(one: list, other: list, label: str, rtol: float = 1e-4) -> None:
    """Two runs of one variant whose outputs differ (``one``/``other``: its rankings, :func:`rankings_by_policy`) ranked
    the same slots alike within ``rtol`` of each ranking's scale up to the first ranking of slots that differ: what
    they kept could differ only at scores tied within their rounding (a row's matrix products over a block of rows
    round in the last float32 bits, and KNorm's 16-bit norm one float32 step from a rounding boundary rounds either
    way)."""
    for (layer, positions, ranking), (other_layer, other_positions, other_ranking) in zip(one, other):
        assert layer == other_layer, label
        if not torch.equal(positions, other_positions):
            return  # an eviction before kept other slots, from rankings alike within rtol: a near-tie
        finite = ranking.isfinite()
        assert torch.equal(finite, other_ranking.isfinite()), label
        assert torch.equal(ranking[~finite], other_ranking[~finite]), label
        if bool(finite.any()):
            spread = float((ranking[finite] - other_ranking[finite]).abs().max())
            assert spread <= rtol * float(ranking[finite].abs().max()), f"{label}: layer {layer} ranked apart"
    raise AssertionError(f"{label}: the outputs differ, every ranking alike")
