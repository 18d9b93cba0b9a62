"""DuoAttention (``duo_attention``): kvpress's calibration-free head scores and kept sets (fixture by
scripts/kvpress_fixtures.py), the ends of its streaming share, the calibration made once per model, its refusals."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbench.engine import Engine
from kvbench.errors import KVBenchError
from kvbench.models import load_model, model_config
from kvbench.policies import build_policy
from kvbench.policies.methods import duo_attention
from tests.helpers import TOKENIZER, kept_masks, random_prompt, refused, tiny_model, unpacked_mask

FIXTURE = Path(__file__).parent / "fixtures" / "kvpress" / "duo_attention.json"
#: a calibration the tiny models run in a moment
SMALL = {"samples": 4, "sample_chars": 300, "query_length": 40, "n_sink": 4}


@pytest.mark.model
def test_head_scores_and_kept_sets_equal_kvpress():
    """SmolLM2's 30 × 3 head scores (on the fixture's 8 calibration texts) equal the press's within float32 rounding
    (bit for bit on the CPU that made the fixture; a CPU with other matrix kernels rounds some in the last bits), with
    no near-tie at the streaming share's cut, and so every layer and head keeps what the press does not mask: half
    the heads their first 128 and last 256 of 512 tokens, the others all (3 prompts)."""
    fixture = json.loads(FIXTURE.read_text())
    loaded = load_model(model_config("smollm2_135m"))
    policy = build_policy("duo_attention", {"n_sink": fixture["n_sink"], "samples": fixture["samples"]})
    runner = Engine(loaded.model, policy, fixture["kept"], tokenizer=loaded.tokenizer)
    scores = duo_attention.HEAD_SCORES[loaded.model]
    press_scores = np.frombuffer(base64.b64decode(fixture["head_scores"]), dtype=np.float32).reshape(30, 3)
    ours, theirs = next(iter(scores.values())), torch.from_numpy(press_scores.copy())
    assert len(scores) == 1 and torch.allclose(ours, theirs, rtol=1e-5, atol=0)
    ranked = theirs.flatten().sort().values  # the streaming share: the 45 lowest
    assert ranked[45] - ranked[44] > 1e-5 * ranked[45]  # no near-tie at the cut: the rounding cannot move it
    assert torch.equal(policy.streaming_heads.flatten(), theirs.flatten() <= ranked[44])
    for prompt in fixture["prompts"]:
        ids = prompt["ids"]
        cache = runner.new_cache(len(ids))
        runner.prefill(cache, ids)
        for ours, theirs in zip(kept_masks(cache, len(ids)), prompt["kept_masks"]):
            assert torch.equal(ours, unpacked_mask(theirs, ours.shape[0], len(ids)))
    assert int(policy.streaming_heads.sum()) == 45  # round(90 · 0.5)


def prefilled(settings: dict, budget: int = 24, length: int = 120, model=None):
    runner = Engine(model or tiny_model(), build_policy("duo_attention", settings), budget, tokenizer=TOKENIZER)
    cache = runner.new_cache(length)
    runner.prefill(cache, random_prompt(length))
    return runner, cache


def test_the_ends_of_the_streaming_share():
    """No streaming head: the full cache; every head streaming: StreamingLLM (sink) at the budget, one length."""
    _, none = prefilled({**SMALL, "streaming": 0.0})
    assert all(bool(mask.all()) for mask in kept_masks(none, 120))
    _, every = prefilled({**SMALL, "streaming": 1.0})
    sink = Engine(tiny_model(), build_policy("sink"), 24, tokenizer=TOKENIZER)
    cache = sink.new_cache(120)
    sink.prefill(cache, random_prompt(120))
    assert all(torch.equal(a, b) for a, b in zip(kept_masks(every, 120), kept_masks(cache, 120)))


def test_heads_hold_their_own_lengths_and_bytes():
    """A mixed share: streaming heads hold the budget, retrieval heads the prompt, and the layer's bytes are what they
    hold (head-wise, as AdaKV)."""
    runner, cache = prefilled({**SMALL, "streaming": 0.5})
    streaming = runner.policy.streaming_heads
    assert 0 < int(streaming.sum()) < streaming.numel()
    for layer, heads, masks in zip(cache.eviction_layers, streaming, kept_masks(cache, 120)):
        assert masks.sum(-1).tolist() == [24 if head else 120 for head in heads.tolist()]
        entries = int(masks.sum()) * layer.keys.shape[-1] * 2 * layer.keys.element_size()
        assert layer.held_bytes() == entries


def test_calibrated_once_per_model(monkeypatch):
    """A model's head scores are computed once for every runner (and budget) of the same calibration settings."""
    calls = []
    scores = duo_attention.head_scores
    monkeypatch.setattr(duo_attention, "head_scores", lambda *args: calls.append(1) or scores(*args))
    model = tiny_model()
    for budget in (16, 24, 32):
        prefilled({**SMALL, "streaming": 0.5}, budget, model=model)
    prefilled({**SMALL, "streaming": 0.25}, model=model)  # another share of the same scores
    assert len(calls) == 1
    prefilled({**SMALL, "streaming": 0.5, "query_length": 30}, model=model)
    assert len(calls) == 2


def test_refusals():
    policy = build_policy("duo_attention")
    assert "engine.regime=chunked" in (policy.refusal("chunked", False) or "")
    assert "engine.decode_evict=true" in (policy.refusal("oneshot", False, decode_evict=True) or "")
    assert "use it alone" in (build_policy("duo_attention+calidrop").refusal("oneshot", False) or "")
    with pytest.raises(KVBenchError, match="needs the tokenizer"):
        Engine(tiny_model(), build_policy("duo_attention", {"streaming": 0.5}), 24)
    with pytest.raises(KVBenchError, match="calibration text has"):
        prefilled({**SMALL, "sample_chars": 10**9, "streaming": 0.5})


def test_a_model_fusing_its_projections_is_refused_before_it_loads(tmp_path, capsys):
    """Phi-3 fuses q/k/v into ``qkv_proj``, which the head scores cannot read: refused in one line by ``kvbench run``
    before the weights load (exit 2, nothing written) and by an engine built on the model; a share that scores nothing
    runs."""

    run = ["run", "model=tiny_phi3", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=640"]
    out = tmp_path / "run"
    assert "fuses (qkv_proj)" in refused(capsys, [*run, "policy=duo_attention", "budget=64", f"output_dir={out}"], out)
    model = load_model(model_config("tiny_phi3")).model
    with pytest.raises(KVBenchError, match=r"fuses \(qkv_proj\)"):
        Engine(model, build_policy("duo_attention", {**SMALL, "streaming": 0.5}), 24, tokenizer=TOKENIZER)
    Engine(model, build_policy("duo_attention", {**SMALL, "streaming": 1.0}), 24, tokenizer=TOKENIZER)


@pytest.mark.parametrize("spec", ["duo_attention", "simlayerkv"])
def test_a_byte_budget_is_refused_in_one_line(spec, tmp_path, capsys):
    """Keeping whole heads (or layers) whatever the budget, neither can be bound by bytes: one line, exit 2, nothing
    written."""

    run = ["run", "model=tiny_llama", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=640"]
    out = tmp_path / "run"
    assert "bytes cannot bound it" in refused(capsys, [*run, f"policy={spec}", "budget=0.2x", f"output_dir={out}"], out)


def test_grouped_rows_give_each_alone():
    """Variants of a mixed share (heads of their own lengths) and a pruned one, prefilled by one shared forward and
    decoded as rows together, give what each gives alone."""
    from tests.helpers import assert_shared_gives_each_alone

    model = tiny_model()
    runners = [
        Engine(model, build_policy(spec, settings), budget, tokenizer=TOKENIZER, record_kept=True)
        for spec, settings, budget in [
            ("duo_attention", {**SMALL, "streaming": 0.5}, 16),
            ("duo_attention", {**SMALL, "streaming": 0.5}, 40),
            ("duo_attention", {**SMALL, "streaming": 0.25}, 24),
            ("snapkv+think", {"window": 8}, 24),
            ("simlayerkv", {"lazy_threshold": 0.3}, 24),
        ]
    ]
    assert_shared_gives_each_alone(runners, random_prompt(90), 6, batch_size=4)
