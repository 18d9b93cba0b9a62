"""KIVI as the cache's representation (``cache.quant=kivi2|kivi4``, kvbench/engine/kivi.py): a layer holds its keys per
channel and its values per token as packed int32 levels past a full-precision residual, step for step as the released
``LlamaAttention_KIVI`` holds them (its state transcribed below), composed with any policy that evicts at prefill; a
byte budget buys it more tokens; the settings that cannot hold are one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from kvbench.cli import main
from kvbench.config import compose
from kvbench.engine import Engine
from kvbench.engine.kivi import Kivi, KiviEntries, joined, quantize
from kvbench.engine.layer import EvictionLayer
from kvbench.errors import KVBenchError
from kvbench.policies import build_policy
from tests.helpers import TOKENIZER, random_prompt, refused, tiny_model

LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 3, 2, 16, 4  # tiny_model's


class ReleasedState:
    """The released code's cache of one layer (jy-yuan/KIVI, models/llama_kivi.py, ``LlamaAttention_KIVI.forward``):
    its prefill split and, at each decode step, the token appended, the layer attended, then the residual quantised —
    the keys once ``residual`` of them are full, the oldest value once more than ``residual`` are."""

    def __init__(self, kivi: Kivi, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.kivi, tokens = kivi, keys.shape[2]
        whole = tokens - tokens % kivi.residual  # key_states_quant: the whole residuals
        self.key_quant = quantize(keys[:, :, :whole], kivi.bits, kivi.group_size, 2) if whole else None
        self.key_full = keys[:, :, whole:]
        past = max(0, tokens - kivi.residual)  # value_states_quant: before the last residual
        self.value_quant = quantize(values[:, :, :past], kivi.bits, kivi.group_size, 3) if past else None
        self.value_full = values[:, :, past:]

    def step(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one token; returns what its query attends (dequantised, then full), then quantises as the code."""
        self.key_full = torch.cat([self.key_full, key], dim=2)
        self.value_full = torch.cat([self.value_full, value], dim=2)
        attended = tuple(
            full if held is None else torch.cat([held.dequantized(), full], dim=2)
            for held, full in ((self.key_quant, self.key_full), (self.value_quant, self.value_full))
        )
        kivi = self.kivi
        if self.key_full.shape[2] == kivi.residual:
            self.key_quant = joined(self.key_quant, quantize(self.key_full, kivi.bits, kivi.group_size, 2))
            self.key_full = self.key_full[:, :, :0]
        if self.value_full.shape[2] > kivi.residual:
            oldest = quantize(self.value_full[:, :, :1], kivi.bits, kivi.group_size, 3)
            self.value_quant, self.value_full = joined(self.value_quant, oldest), self.value_full[:, :, 1:]
        return attended


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("prompt", [1, 40, 64, 100, 129])
def test_a_layer_holds_and_attends_what_the_released_cache_does_at_every_step(bits, prompt):
    """Prompts below, at and past a residual (and not whole groups) then 150 decode steps, through two residuals:
    at every step the layer attends exactly the released state's keys and values."""
    kivi = Kivi(bits, group_size=16, residual=32)
    generator = torch.Generator().manual_seed(prompt)
    keys, values = (torch.randn(1, 2, prompt + 150, 32, generator=generator) for _ in range(2))
    reference = ReleasedState(kivi, keys[:, :, :prompt], values[:, :, :prompt])
    layer = EvictionLayer()
    layer.append(keys[:, :, :prompt], values[:, :, :prompt], torch.arange(prompt))
    for step in range(prompt, prompt + 150):
        layer.roll(kivi)  # as EvictionCache.update before a decoded token's append
        layer.append(keys[:, :, step : step + 1], values[:, :, step : step + 1], torch.tensor([step]))
        ours = layer.attended()
        expected = reference.step(keys[:, :, step : step + 1], values[:, :, step : step + 1])
        assert ours[2] is None and torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1]), step
        assert layer.get_seq_length() == step + 1 == layer.tokens_per_head()


def test_the_bytes_held_are_the_packed_levels_the_groups_and_the_residual():
    """200 tokens at 2 bits, groups of 32, a residual of 128: 128 keys and 72 values quantised (int32 codes, a
    float32 step and minimum per group), 72 keys and 128 values in float32."""
    kivi, layer = Kivi(2), EvictionLayer()
    layer.append(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), torch.arange(200))
    layer.roll(kivi)
    entries = layer.quantized
    assert entries is not None and entries.tokens() == (128, 72)
    assert entries.keys is not None and entries.keys.codes.dtype == torch.int32
    keys = 2 * 64 * (128 * 2 // 32 * 4 + 128 // 32 * 2 * 4)  # codes + steps and minima, per head and channel
    values = 2 * 72 * (64 * 2 // 32 * 4 + 64 // 32 * 2 * 4)  # per head and token
    full = 2 * (72 + 128) * 64 * 4
    assert layer.held_bytes() == keys + values + full < 2 * 2 * 200 * 64 * 4


@pytest.mark.parametrize("spec", ["full", "snapkv", "h2o+obcache_joint", "cake", "snapkv+calidrop"])
def test_a_quantised_cache_keeps_the_policys_entries_and_generates_from_their_levels(spec):
    """The policy evicts from full-precision entries, then they are quantised: the same kept positions and first
    token as without quantisation (the prompt is read in full precision), held bytes a fraction of theirs, and the
    decode attends the dequantised entries (4 bits: close to the full-precision logits, not equal)."""
    model, prompt = tiny_model(), random_prompt(300)
    plain = Engine(model, build_policy(spec, {}), 160, tokenizer=TOKENIZER, record_kept=True)
    quantised = Engine(model, build_policy(spec, {}), 160, tokenizer=TOKENIZER, record_kept=True, quant=Kivi(4, 16, 32))
    ours, theirs = quantised.generate(prompt, 12), plain.generate(prompt, 12)
    assert ours.kept == theirs.kept and ours.token_ids[0] == theirs.token_ids[0]
    held = theirs.kv.after_prefill_tokens_per_layer[0]  # CAKE's layers their own budgets
    assert ours.kv.after_prefill_tokens_per_layer == theirs.kv.after_prefill_tokens_per_layer
    assert held == (300 if spec == "full" else 160) or spec == "cake"
    assert ours.kv.after_prefill_bytes < 0.45 * theirs.kv.after_prefill_bytes
    cache = quantised.new_cache(len(prompt))
    quantised.prefill(cache, prompt)
    cache.end_prefill()
    layer = cache.eviction_layers[0]
    assert layer.quantized is not None and layer.quantized.tokens() == (held // 32 * 32, held - 32)


def test_a_context_reconstructed_before_it_is_evicted_is_quantised_after():
    """KVzip reads its context again (forwards after the prompt) before it evicts: the layers are quantised once it
    has, keeping KVzip's kept sets, the question read into the residual."""
    model, prompt = tiny_model(), random_prompt(240)
    runs = [
        Engine(model, build_policy("kvzip", {}), 64, tokenizer=TOKENIZER, record_kept=True, quant=quant)
        for quant in (None, Kivi(4, 16, 32))
    ]
    plain, quantised = (runner.generate(prompt, 6, question_start=200) for runner in runs)
    assert quantised.kept == plain.kept and quantised.kv.after_prefill_bytes < 0.6 * plain.kv.after_prefill_bytes


def test_rows_decoded_together_give_each_quantised_row_alone():
    """A quantised row is never on the shared shelves; grouped with others (a shared prefill), each gives its own."""
    from tests.helpers import assert_shared_gives_each_alone

    model, prompt = tiny_model(), random_prompt(200)
    runners = [
        Engine(model, build_policy(spec, {}), 96, tokenizer=TOKENIZER, record_kept=True, quant=quant)
        for spec in ("snapkv", "tova")
        for quant in (None, Kivi(2, 16, 32))
    ]
    assert_shared_gives_each_alone(runners, prompt, 6, batch_size=4)


def test_a_byte_budget_buys_a_quantised_cache_more_tokens_within_the_same_bytes():
    """``0.25x`` of the full cache's bytes: a 2-bit cache (groups of 16, a residual of 32) keeps more tokens than a
    float32 one and holds at most the quarter too."""
    model, prompt = tiny_model(), random_prompt(400)
    full_bytes = 400 * LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32
    plain = Engine(model, build_policy("snapkv", {}), "0.25x", tokenizer=TOKENIZER).generate(prompt, 1).kv
    quant = Kivi(2, 16, 32)
    quantised = Engine(model, build_policy("snapkv", {}), "0.25x", tokenizer=TOKENIZER, quant=quant)
    kv = quantised.generate(prompt, 1).kv
    assert plain.after_prefill_tokens_per_layer == [100] * LAYERS
    assert kv.after_prefill_tokens_per_layer[0] > 250
    assert kv.after_prefill_bytes <= 0.25 * full_bytes


def test_the_cache_settings_are_checked_and_the_undefined_combinations_refused():
    with pytest.raises(KVBenchError, match="cache.quant=kivi3: valid choices: none, kivi2, kivi4"):
        Kivi.of("kivi3", 32, 128)
    with pytest.raises(KVBenchError, match="a residual of whole groups"):
        Kivi.of("kivi2", 32, 100)
    assert Kivi.of("none", 32, 128) is None and Kivi.of("kivi4", 32, 128) == Kivi(4, 32, 128)
    model = tiny_model()
    streaming = Engine(model, build_policy("h2o", {}), 64, regime="streaming", quant=Kivi(2, 16, 32))
    with pytest.raises(KVBenchError, match="no eviction may follow"):
        streaming.new_cache(100)
    headwise = Engine(model, build_policy("snapkv+adakv", {}), 64, quant=Kivi(2, 16, 32))
    with pytest.raises(KVBenchError, match="keeps one per head"):
        headwise.new_cache(100)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cache.quant=kivi3", "cache.quant=kivi3: must be one of none, kivi2, kivi4"),
        ("cache.residual=0", "cache.residual=0: must be a token count ≥ 1"),
        ("cache.quant=kivi2", "KIVI quantises each value in groups of channels, and this model's heads have 16"),
    ],
)
def test_a_run_with_a_bad_cache_setting_is_one_line_and_writes_nothing(tmp_path, capsys, override, message):
    out = tmp_path / "run"
    run = ["run", "model=tiny_llama", "task=ruler", "task.num_samples=1", override, f"output_dir={out}"]
    assert message in refused(capsys, run, out)


def test_a_quantised_run_records_its_bytes_under_its_own_name(tmp_path):
    ruler = ["model=tiny_llama", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=640"]
    runs = {}
    for quant in ("none", "kivi2"):
        out = tmp_path / quant
        cache = [f"cache.quant={quant}", "cache.group_size=16"]
        main(["run", *ruler, "task.num_samples=1", "policy=snapkv", "budget=256", *cache, f"output_dir={out}"])
        runs[quant] = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])["kv"]
        label = json.loads((out / "metrics.json").read_text())["label"]
        assert label == ("snapkv" if quant == "none" else "snapkv+kivi2")
        named = compose(["policy=snapkv", "budget=256", f"cache.quant={quant}"]).output_dir
        assert named.split("/")[-1].startswith("snapkv-256-" if quant == "none" else "snapkv+kivi2-256-")
    assert runs["kivi2"]["after_prefill_tokens_per_layer"] == runs["none"]["after_prefill_tokens_per_layer"]
    assert runs["kivi2"]["after_prefill_bytes"] < 0.5 * runs["none"]["after_prefill_bytes"]


def test_the_entries_of_an_empty_store_attend_as_given():
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    attended = KiviEntries().attended(keys, values)
    assert attended[0] is keys and attended[1] is values


@pytest.mark.model
def test_the_leaderboards_bytes_axis_at_smoke_scale(tmp_path, capsys):
    """``+experiment=leaderboard_bytes_smoke``: one grouped sweep on SmolLM2 at a fifth of the full cache's bytes —
    SnapKV keeps a fifth of the tokens, over a 2-bit cache more of them in no more bytes; Quest holds everything and
    reads about a fifth —, then the leaderboard's cells by label and the plot on the bytes held; the paper-scale sweeps'
    63 jobs each (RULER, the needle grid) are valid."""
    main(["run", "-m", "+experiment=leaderboard_bytes_smoke", f"hydra.sweep.dir={tmp_path}"])
    runs = {path.parent.name.split("-0.2x")[0]: path.parent for path in tmp_path.glob("*/*/*/metrics.json")}
    assert sorted(runs) == ["full", "full+kivi2", "quest", "quest+kivi2", "snapkv", "snapkv+kivi2"]

    def kv(name: str) -> list[dict]:
        lines = (runs[name] / "predictions.jsonl").read_text().splitlines()
        return [json.loads(line)["kv"] for line in lines]

    for plain, quantised in zip(kv("snapkv"), kv("snapkv+kivi2")):
        assert quantised["after_prefill_bytes"] <= 0.2 * quantised["full_bytes"]
        assert quantised["after_prefill_tokens_per_layer"][0] > 2 * plain["after_prefill_tokens_per_layer"][0]
    assert [one["after_prefill_bytes"] for one in kv("quest")] == [one["after_prefill_bytes"] for one in kv("full")]
    quest = json.loads((runs["quest"] / "metrics.json").read_text())
    assert 0.1 < quest["policy_stats"]["read_share"] < 0.4
    capsys.readouterr()
    main(["leaderboard", str(tmp_path)])
    assert "snapkv+kivi2" in capsys.readouterr().out
    main(["plot", str(tmp_path), "--kind", "budget", "--x", "bytes"])
    assert "bytes_curves.png" in capsys.readouterr().out
    for experiment in ("leaderboard_bytes", "leaderboard_bytes_needle"):  # RULER's and the needle grid's
        main(["plan", "-m", f"+experiment={experiment}"])
        assert "63 jobs, 0 invalid" in capsys.readouterr().err
