"""Grouped runs (:func:`kvbench.run.run_group`): the jobs of a sweep that differ only in policy and budget share one
model load and one task's samples, and give what the same jobs run one at a time give."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvbench.run.group
import kvbench.run.lifecycle
import kvbench.run.progress
from kvbench import config_dict
from kvbench.config import compose
from kvbench.engine import Engine
from kvbench.engine.scoring import Scorer, sums_key
from kvbench.engine.shared import generate_shared
from kvbench.engine.shelf import Shelf
from kvbench.errors import KVBenchError, SharedPassWarning
from kvbench.identity import load_group_key
from kvbench.policies import build_policy
from kvbench.run import run, run_group
from kvbench.rundir import RunDir
from tests.helpers import (
    ARCHITECTURE_SHARES,
    ARCHITECTURES,
    VARIANTS,
    architecture_variants,
    assert_shared_gives_each_alone,
    question_start,
    random_prompt,
    registry_engines,
    tiny_model,
)
from tests.test_plan import TINY as PLAN_TINY

#: two RULER samples on the tiny model, 16 new tokens each (RULER's NIAH asks 128 and the random model never stops; a
#: variant's kept sets decide its first token already)
TINY = [*PLAN_TINY, "engine.save_kept=true", "task.tokens_to_generate=16"]


def outcome(directory: Path) -> dict[str, object]:
    """What a job left that a faster path must not change: its predictions (less timings) and kept sets."""
    if not (directory / "predictions.jsonl").exists():
        return {"written": False}
    records = [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("timing")
    kept = {path.name: json.loads(path.read_text()) for path in sorted((directory / "kept").glob("*.json"))}
    return {"records": records, "kept": kept}


@pytest.fixture
def load_count(monkeypatch) -> list[int]:
    """How many times a model was loaded."""
    loads = [0]
    load = kvbench.run.lifecycle.load_model

    def counted(cfg):
        loads[0] += 1
        return load(cfg)

    monkeypatch.setattr(kvbench.run.lifecycle, "load_model", counted)
    return loads


def test_a_group_gives_what_separate_runs_give(tmp_path, load_count):
    """Every base × {none, each applicable modifier}, oneshot: grouped, one model load and the same predictions,
    kept sets and errors (a variant that cannot run fails alone, the others run) as one run each, with and without
    ``share_prefill`` (a sample's variants prefilled by shared forwards of at most the batch's rows each, so a group's
    rows held are the batch's, whatever the number of variants); the separate runs made once for both."""
    batch = 16
    settings = [*TINY, "task.num_samples=1", "budget=64", f"engine.batch_size={batch}"]
    cfgs = [compose([*settings, f"policy={spec}"]) for spec in VARIANTS]
    assert len({load_group_key(config_dict(cfg, resolve=True)) for cfg in cfgs}) == 1
    separate: list[object] = []
    for number, cfg in enumerate(cfgs):
        try:
            run(cfg, tmp_path / "separate" / str(number))
            separate.append(None)
        except Exception as error:
            separate.append(str(error))
    assert any(error is None for error in separate) and any(error is not None for error in separate)
    assert len(VARIANTS) > 4 * batch
    for share_prefill in (False, True):
        grouped_dir = tmp_path / f"grouped-{share_prefill}"
        loads = load_count[0]
        grouped = run_group([(cfg, grouped_dir / str(number)) for number, cfg in enumerate(cfgs)], share_prefill)
        assert load_count[0] - loads == 1
        assert [str(result) if isinstance(result, Exception) else None for result in grouped] == separate
        shared_by = [
            json.loads(line)["timing"].get("prefill_shared_by", 1)
            for path in grouped_dir.glob("*/predictions.jsonl")
            for line in path.read_text().splitlines()
        ]
        assert (max(shared_by) > 1) == share_prefill and max(shared_by) <= batch  # prefills of at most the batch
        timings = [json.loads(path.read_text())["timing"] for path in grouped_dir.glob("*/metrics.json")]
        assert timings and all(timing["load_shared_by"] == len(VARIANTS) for timing in timings)
        assert len({timing["load_seconds"] for timing in timings}) == 1 and timings[0]["load_seconds"] > 0
        assert (max(timing["prefill_shared_by"] for timing in timings) > 1) == share_prefill
        for number, spec in enumerate(VARIANTS):
            assert outcome(grouped_dir / str(number)) == outcome(tmp_path / "separate" / str(number)), spec


@pytest.mark.parametrize("evicting", [False, True])
def test_stored_rows_give_what_separate_runs_attended_each_alone_give(tmp_path, monkeypatch, evicting):
    """``engine.rows_attention=stored``: a group's rows that only append and attend decode held together, head-wise
    ones (AdaKV) by their heads' own lengths, CaliDrop's with its state beside them; each run's predictions, kept sets
    and cache sizes are those of its run with every row attended alone. Evicting every 4th token as they decode, the
    rows that rank from the keys, a window of queries or H2O's running sums (the shelf adding them) are held together
    between their evictions."""
    specs = ["full", "snapkv", "pyramidkv", "cake", "h2o", "snapkv+calidrop", "snapkv+adakv", "tova"]
    settings = [*TINY, "task.num_samples=2", "budget=64", "engine.batch_size=8"]
    if evicting:
        settings += ["engine.decode_evict=true", "engine.decode_interval=4"]
    alone = [compose([*settings, f"policy={spec}"]) for spec in specs]
    stored = [compose([*settings, f"policy={spec}", "engine.rows_attention=stored"]) for spec in specs]
    run_group([(cfg, tmp_path / "each" / str(number)) for number, cfg in enumerate(alone)], True)
    added: list[str] = []
    place = Shelf.place
    monkeypatch.setattr(
        Shelf,
        "place",
        lambda shelf, units: added.extend(row.cache.policy.spec for row, _ in units) or place(shelf, units),
    )
    run_group([(cfg, tmp_path / "stored" / str(number)) for number, cfg in enumerate(stored)], True)
    alone_while_evicting = {"cake", "snapkv+calidrop", "snapkv+adakv"}  # store.stored_between_evictions
    assert set(added) == set(specs) - (alone_while_evicting if evicting else set())
    for number, spec in enumerate(specs):
        assert outcome(tmp_path / "stored" / str(number)) == outcome(tmp_path / "each" / str(number)), spec


def test_a_single_jobs_failing_sample_is_its_error_raised_and_what_it_wrote_is_kept(tmp_path, monkeypatch):
    """A job runs as a group of one: a sample that fails is the job's error, raised (``kvbench run`` prints it in one
    line), the samples finished before it kept for a resume, no metrics written; no shared-pass warning or rerun
    alone (a group of one shares no pass)."""
    cfg = compose([*TINY, "policy=h2o", "budget=64", "engine.batch_size=1"])
    decode, calls = kvbench.run.group.decode_shared, []

    def second_fails(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KVBenchError("the second sample failed")
        yield from decode(*args)

    monkeypatch.setattr(kvbench.run.group, "decode_shared", second_fails)
    with pytest.raises(KVBenchError, match="the second sample failed"):
        run(cfg, tmp_path / "job")
    assert len((tmp_path / "job" / "predictions.jsonl").read_text().splitlines()) == 1
    assert not (tmp_path / "job" / "metrics.json").exists() and len(calls) == 2


def test_a_failed_shared_pass_is_a_warning_and_its_samples_run_alone(tmp_path, monkeypatch):
    """A shared pass that raises is no silent slowness: a :class:`SharedPassWarning` naming its exception (an error
    under the tests unless expected, pyproject.toml), and each sample then runs alone, to the same records."""
    cfgs = [compose([*TINY, f"policy={spec}", "budget=64"]) for spec in ("h2o", "tova")]
    expected = run_group([(cfg, tmp_path / "shared" / spec) for cfg, spec in zip(cfgs, ("h2o", "tova"))], True)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the shared path")
        yield

    monkeypatch.setattr(kvbench.run.group, "decode_shared", broken)
    with pytest.warns(SharedPassWarning, match=r"shared pass failed \(RuntimeError: a bug in the shared path\)"):
        alone = run_group([(cfg, tmp_path / "alone" / spec) for cfg, spec in zip(cfgs, ("h2o", "tova"))], True)
    assert [metrics["scores"] for metrics in alone] == [metrics["scores"] for metrics in expected]
    for spec in ("h2o", "tova"):
        assert outcome(tmp_path / "alone" / spec) == outcome(tmp_path / "shared" / spec)


@pytest.mark.parametrize("share_prefill", [False, True])
def test_a_finished_group_loads_nothing_and_a_resumed_one_runs_only_what_is_missing(
    tmp_path, load_count, share_prefill
):
    """Run again, a finished group loads no model; with one job's last sample removed, only that sample runs."""
    cfgs = [compose([*TINY, f"policy={spec}", "budget=64"]) for spec in ("h2o", "tova")]
    members = [(cfg, tmp_path / spec) for cfg, spec in zip(cfgs, ("h2o", "tova"))]
    first = run_group(members, share_prefill)
    before = outcome(tmp_path / "tova")
    loads = load_count[0]
    assert run_group(members, share_prefill) == first and load_count[0] == loads
    predictions = tmp_path / "tova" / "predictions.jsonl"
    lines = predictions.read_text().splitlines()
    predictions.write_text(lines[0] + "\n")
    (tmp_path / "tova" / "metrics.json").unlink()
    again = run_group(members, share_prefill)
    assert load_count[0] == loads + 1
    assert predictions.read_text().splitlines()[0] == lines[0]  # the finished sample is not redone
    assert outcome(tmp_path / "tova") == before and again[1]["scores"] == first[1]["scores"]


def test_plan_numbers_each_jobs_group():
    """``kvbench plan -m``: jobs differing only in policy and budget share a group; another context length is
    another group; with ``hydra.sweeper.group=false`` no job has one."""
    from kvbench.plan import plan_lines

    sweep = ["-m", *TINY[:3], "task.num_samples=1", "policy=h2o,tova", "budget=32,64", "task.context_length=512,640"]
    lines = list(plan_lines(sweep))
    by_length: dict[int, set[int]] = {}
    for line in lines:
        by_length.setdefault(line["config"]["task"]["context_length"], set()).add(line["group"])
    assert len(lines) == 8 and sorted(by_length) == [512, 640] and by_length[512] != by_length[640]
    assert all(len(groups) == 1 for groups in by_length.values())
    assert {line["group"] for line in plan_lines([*sweep, "hydra.sweeper.group=false"])} == {None}
    assert {line["prefill_group"] for line in plan_lines([*sweep, "hydra.sweeper.share_prefill=false"])} == {None}


def test_plan_counts_a_shared_prefill_once(capsys):
    """``kvbench plan -m`` of a sweep sharing its prefills: the jobs of a group with one head layout (whatever the
    policy and budget) share a ``prefill_group``, whose prefill tokens the summary counts once."""
    from kvbench.plan import plan_main as main

    sweep = ["-m", *TINY[:3], "task.num_samples=1", "policy=h2o,tova,snapkv", "budget=64,96", "policy.gqa=mean,repeat"]
    main([*sweep, "hydra.sweeper.share_prefill=true"])
    printed = capsys.readouterr()
    lines = [json.loads(line) for line in printed.out.splitlines()]
    by_layout: dict[str, set[int]] = {}
    for line in lines:
        by_layout.setdefault(line["config"]["policy"]["gqa"], set()).add(line["prefill_group"])
    assert len(by_layout["mean"]) == len(by_layout["repeat"]) == 1 and by_layout["mean"] != by_layout["repeat"]
    one = lines[0]["tokens"]["prefill"]
    assert f"prefills shared: {2 * one} tokens prefilled, not {12 * one}" in printed.err


def test_the_architectures_share_the_registry_each_variant_on_three():
    """The registry-wide tests' shares (:data:`ARCHITECTURE_SHARES`): every base alone on all seven architectures,
    every variant with modifiers on Llama, on exactly one sliding-window architecture and on exactly one dense one."""
    assert set(ARCHITECTURE_SHARES) == set(ARCHITECTURES)
    sliding = {"gemma3", "gpt_oss"}
    for spec in VARIANTS:
        running = {architecture for architecture in ARCHITECTURES if spec in architecture_variants(architecture)}
        if "+" not in spec:
            assert running == set(ARCHITECTURES), spec
        else:
            assert "llama" in running and len(running & sliding) == 1 and len(running - sliding) == 2, spec


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_one_shared_prefill_gives_what_each_variant_gives_alone(architecture):
    """Every base × {none, each applicable modifier} (the architecture's share: :func:`architecture_variants`) at two
    budgets, both head layouts, and the full cache (budget ≥ the prompt), on one prompt: :func:`generate_shared` gives
    each variant the tokens, kept sets, cache sizes and policy statistics of its own :meth:`Engine.generate` — the
    variants attended by the backend from one forward, H2O's with sums from each query's normaliser among them."""
    model = tiny_model(architecture)
    prompt = random_prompt(160)
    cases = [(32, "oneshot", {}), (48, "oneshot", {}), (48, "oneshot", {"gqa": "repeat"})]
    variants = architecture_variants(architecture)
    engines, _ = registry_engines(model, cases, len(prompt), record_kept=True, variants=variants)
    engines.append(Engine(model, build_policy("snapkv"), 512, record_kept=True))
    shared = assert_shared_gives_each_alone(engines, prompt, 6)
    caches = [engine.new_cache(len(prompt), question_start(engine, prompt) is not None) for engine in engines]
    assert sum(engine.shares_prefill(cache) for engine, cache in zip(engines, caches)) > len(engines) / 2
    normalised = [output for engine, output in zip(engines, shared) if sums_key(engine.policy)]
    assert normalised and min(output.prefill_shared_by for output in normalised) > 1  # H2O reads a shared forward


@pytest.mark.parametrize(
    ("spec", "rankings"),
    [("snapkv", 1), ("snapkv+obcache_joint", 1), ("cake", 1), ("snapkv+criticalkv", 3), ("h2o", 3)],
)
def test_a_shared_prefill_ranks_each_layer_once_per_scoring_setting(monkeypatch, spec, rankings):
    """One base at three budgets in one shared prefill: where its windows are the budget's alike (SnapKV's 32 queries
    and recent tokens, with or without a re-ranking modifier; CAKE's cascade stage at each average budget) each layer
    is ranked once and every budget selects from that ranking (each variant's output equal to its own run:
    :func:`test_one_shared_prefill_gives_what_each_variant_gives_alone`); a ranking that reads the budget (CriticalKV's
    first stage) or windows that scale with it (H2O's recent half of the budget) are ranked per variant."""
    model, prompt = tiny_model(), random_prompt(160)
    counted: list[str] = []
    scores = Scorer.scores
    monkeypatch.setattr(
        Scorer, "scores", lambda scorer, *args: counted.append(scorer.policy.spec) or scores(scorer, *args)
    )
    engines = [Engine(model, build_policy(spec), budget) for budget in (48, 64, 96)]
    shared = generate_shared(engines, prompt, 2)
    assert len(counted) == rankings * model.config.num_hidden_layers
    counted.clear()
    alone = [engine.generate(prompt, 2) for engine in engines]
    assert [output.token_ids for output in shared] == [output.token_ids for output in alone]
    assert len(counted) == 3 * model.config.num_hidden_layers


def test_modifiers_that_do_not_re_rank_share_their_bases_ranking(monkeypatch):
    """SnapKV alone, sharing heads (AdaKV) and attending the evicted (CaliDrop, SLAKE), each at two budgets, and CAKE
    with SLAKE's VABS layer budget beside CAKE's own: one shared prefill ranks each layer once for the SnapKV family and
    once for CAKE's (its cascade stages, at the one average budget), however the layers share the budget; each
    variant's tokens equal its own run's, which ranks once per variant and layer."""
    model, prompt = tiny_model(), random_prompt(160)
    counted: list[str] = []
    scores = Scorer.scores
    monkeypatch.setattr(
        Scorer, "scores", lambda scorer, *args: counted.append(scorer.policy.spec) or scores(scorer, *args)
    )
    family = ("snapkv", "snapkv+adakv", "snapkv+calidrop", "snapkv+slake")
    engines = [Engine(model, build_policy(spec), budget) for spec in family for budget in (48, 96)]
    vabs = {"name": "vabs", "alpha": 0.5, "beta": 0.4}
    engines += [
        Engine(model, build_policy("cake"), 64),
        Engine(model, build_policy("cake+slake", {"layer_budget": vabs}), 64),
    ]
    assert engines[-1].policy.layer_budget.name == "vabs"
    shared = generate_shared(engines, prompt, 2)
    assert sorted(set(counted)) == ["cake", "snapkv"] and len(counted) == 2 * model.config.num_hidden_layers
    counted.clear()
    alone = [engine.generate(prompt, 2) for engine in engines]
    assert [output.token_ids for output in shared] == [output.token_ids for output in alone]
    assert len(counted) >= len(engines) * model.config.num_hidden_layers


def test_a_shared_prefill_computes_what_depends_on_the_entries_once(monkeypatch):
    """CriticalKV's projected value norms (``ScoreContext.once``) over two bases at three budgets in one shared
    prefill: computed once per layer, read by all six variants, whose tokens equal their own runs'; alone, once per
    variant and layer."""
    from kvbench.policies.methods import criticalkv

    model, prompt = tiny_model(), random_prompt(160)
    counted: list[int] = []
    norms = criticalkv.projected_norms
    monkeypatch.setattr(criticalkv, "projected_norms", lambda *args: counted.append(1) or norms(*args))
    specs = ("snapkv+criticalkv", "tova+criticalkv")
    engines = [Engine(model, build_policy(spec), budget) for spec in specs for budget in (48, 64, 96)]
    shared = generate_shared(engines, prompt, 2)
    assert len(counted) == model.config.num_hidden_layers
    counted.clear()
    alone = [engine.generate(prompt, 2) for engine in engines]
    assert [output.token_ids for output in shared] == [output.token_ids for output in alone]
    assert len(counted) == len(engines) * model.config.num_hidden_layers


def test_a_shared_prefill_scores_a_base_once_for_the_modifiers_that_re_rank_it(monkeypatch):
    """SnapKV alone and under ChunkKV, CriticalKV and CAOTE (which re-rank its score: ChunkKV and CriticalKV by the
    budget), at three budgets, in one shared prefill: SnapKV's score made once a layer for all twelve variants, whose
    tokens equal their own runs'; alone, once a variant and layer. OBCache re-weights SnapKV's statistic: its own."""
    from kvbench.policies.methods.snapkv import SnapKV

    model, prompt = tiny_model(), random_prompt(160)
    counted: list[str] = []
    score = SnapKV.score
    monkeypatch.setattr(SnapKV, "score", lambda self, context: counted.append(self.spec) or score(self, context))
    specs = ("snapkv", "snapkv+chunkkv", "snapkv+criticalkv", "snapkv+caote", "snapkv+obcache_value")
    engines = [Engine(model, build_policy(spec), budget) for spec in specs for budget in (48, 64, 96)]
    shared = generate_shared(engines, prompt, 2)
    layers = model.config.num_hidden_layers
    assert len(counted) == 2 * layers and counted.count("snapkv+obcache_value") == layers
    counted.clear()
    alone = [engine.generate(prompt, 2) for engine in engines]
    assert [output.token_ids for output in shared] == [output.token_ids for output in alone]
    assert len(counted) == len(engines) * layers


def test_a_shared_prefill_cuts_a_shared_score_into_chunks_once_whatever_the_budget(monkeypatch):
    """ChunkKV over SnapKV and over TOVA, each at three budgets and in both countings, in one shared prefill: each
    base's chunk scores and ranks within chunks (:meth:`ChunkKV.chunks`) made once a layer per base and counting,
    only the chunks kept chosen per budget; after CriticalKV (which re-ranks by the budget) per variant; every
    variant's tokens and kept sets equal its own run's, which cuts once a variant and layer."""
    from kvbench.policies.methods.chunkkv import ChunkKV

    model, prompt = tiny_model(), random_prompt(160)
    counted: list[str] = []
    chunks = ChunkKV.chunks
    monkeypatch.setattr(ChunkKV, "chunks", lambda self, *args: counted.append(self.counting) or chunks(self, *args))
    policies = [
        build_policy(spec, {"counting": counting})
        for spec in ("snapkv+chunkkv", "tova+chunkkv")
        for counting in ("selectable", "kvpress")
    ]
    engines = [Engine(model, policy, budget, record_kept=True) for policy in policies for budget in (48, 64, 96)]
    engines += [Engine(model, build_policy("snapkv+criticalkv+chunkkv"), budget) for budget in (48, 96)]
    shared = generate_shared(engines, prompt, 2)
    layers = model.config.num_hidden_layers
    assert len(counted) == (len(policies) + 2) * layers and counted.count("kvpress") == 2 * layers
    counted.clear()
    alone = [engine.generate(prompt, 2) for engine in engines]
    assert [output.token_ids for output in shared] == [output.token_ids for output in alone]
    assert [output.kept for output in shared] == [output.kept for output in alone]
    assert len(counted) == len(engines) * layers


@pytest.mark.model
def test_on_smollm2_one_shared_prefill_gives_what_each_variant_gives_alone():
    """The same over the registry on the offline SmolLM2 (float32, a 256-token text prompt, budget 64), the variants
    decoded 8 rows at a time after their shared prefill (:func:`~kvbench.engine.rows.decode_rows`): every
    variant's tokens, kept sets, cache sizes and policy statistics equal its own run's. Every base alone and a
    quarter of each modifier's variants (its 1st, 5th, ...), 51 of the 131 specs (the tiny Llama runs them all; the
    slow chunked SmolLM2 test in test_rows.py too)."""
    from kvbench.bench.sections import PARAGRAPH, prompt_tokens
    from kvbench.models import load_model, model_config

    loaded = load_model(model_config("smollm2_135m"))
    prompt = prompt_tokens(loaded.tokenizer, PARAGRAPH, 256)
    modifiers = [spec.partition("+")[2] for spec in VARIANTS]  # "" for a base alone
    variants = [
        spec
        for number, (spec, modifier) in enumerate(zip(VARIANTS, modifiers))
        if not modifier or modifiers[:number].count(modifier) % 4 == 0
    ]
    assert set(modifiers) == {spec.partition("+")[2] for spec in variants}  # every modifier
    settings = {"record_kept": True, "tokenizer": loaded.tokenizer, "variants": variants}
    engines, _ = registry_engines(loaded.model, [(64, "oneshot", {})], len(prompt), **settings)
    assert len(engines) > len(variants) * 0.8
    assert_shared_gives_each_alone(engines, prompt, 4, batch_size=8)


def test_a_shared_group_killed_part_way_finishes_every_sample_once(tmp_path):
    """``kill -9`` of a sweep whose group shares its prefills, part-way; run again, every run directory holds every
    sample exactly once, the finished ones not redone, with the predictions of an uninterrupted sweep."""
    kvbench_command = str(Path(sys.executable).parent / "kvbench")
    sweep = ["run", "-m", *PLAN_TINY[:3], "task.context_length=768", "task.num_samples=40", "policy=snapkv,tova"]
    sweep.append("task.tokens_to_generate=16")
    sweep.append("budget=64")
    sweep.append("hydra.sweeper.share_prefill=true")

    def sweep_into(directory: Path) -> list[str]:
        return [*sweep, f"hydra.sweep.dir={directory}"]

    killed, whole = tmp_path / "killed", tmp_path / "whole"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([kvbench_command, *sweep_into(killed)], env=environment, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not any(len(path.read_text().splitlines()) >= 3 for path in killed.glob("*/*/*/predictions.jsonl")):
        assert time.monotonic() < deadline and process.poll() is None, "no predictions before the deadline"
        time.sleep(0.2)
    process.kill()
    process.wait()
    before = {path.parent.name: path.read_text().splitlines() for path in killed.glob("*/*/*/predictions.jsonl")}
    assert all(len(lines) < 40 for lines in before.values())
    for directory in (killed, whole):
        subprocess.run([kvbench_command, *sweep_into(directory)], env=environment, cwd=tmp_path, check=True)
    runs = sorted(path.parent.name for path in whole.glob("*/*/*/predictions.jsonl"))
    assert len(runs) == 2
    for name in runs:
        (finished,) = killed.glob(f"*/*/{name}/predictions.jsonl")
        (uninterrupted,) = whole.glob(f"*/*/{name}/predictions.jsonl")
        lines = finished.read_text().splitlines()
        assert lines[: len(before.get(name, []))] == before.get(name, [])  # nothing finished was rewritten
        records = RunDir(finished.parent).records()  # a line the kill cut short is not a record
        assert len(records) == len({record["id"] for record in records}) == 40 and len(lines) <= 41
        expected = {record["id"]: record["prediction"] for record in RunDir(uninterrupted.parent).records()}
        assert {record["id"]: record["prediction"] for record in records} == expected


@pytest.mark.parametrize("stop, status, name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_sweep_stopped_by_a_signal_says_so_in_one_line_and_the_same_command_finishes_it(tmp_path, stop, status, name):
    """Ctrl-C (SIGINT) or SIGTERM part way through a grouped sweep: one line saying how many samples were written and
    that the same command resumes, exit 130 / 143; the same command then finishes every sample once."""
    kvbench_command = str(Path(sys.executable).parent / "kvbench")
    sweep = ["run", "-m", *PLAN_TINY[:3], "task.context_length=768", "task.num_samples=40", "policy=snapkv,tova"]
    sweep.append("task.tokens_to_generate=16")
    sweep += ["budget=64", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp_path / "stderr").open("w") as stderr:
        process = subprocess.Popen([kvbench_command, *sweep], env=environment, cwd=tmp_path, stderr=stderr)
        deadline = time.monotonic() + 300
        while not any(path.read_text().count("\n") >= 3 for path in tmp_path.glob("sweep/*/*/*/predictions.jsonl")):
            assert time.monotonic() < deadline and process.poll() is None, "no predictions before the deadline"
            time.sleep(0.2)
        process.send_signal(stop)
        assert process.wait(timeout=120) == status
    last = (tmp_path / "stderr").read_text().strip().splitlines()[-1]
    assert last.startswith(f"kvbench: stopped by {name}: ") and last.endswith("run the same command to resume the rest")
    written = sum(len(RunDir(path.parent).records()) for path in tmp_path.glob("sweep/*/*/*/predictions.jsonl"))
    assert f": {written} samples finished and written" in last and written < 80
    subprocess.run([kvbench_command, *sweep], env=environment, cwd=tmp_path, check=True, capture_output=True)
    for path in tmp_path.glob("sweep/*/*/*/predictions.jsonl"):
        ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
        assert len(ids) == len(set(ids)) == 40


def test_a_task_that_cannot_be_built_fails_every_job_of_its_group_with_its_error(tmp_path, load_count):
    """The group's task is built once, before any model loads: when it fails, each job reports that error (not a
    second, misleading one) and no model was loaded for it."""
    cfgs = [compose([*TINY, "task.context_length=300", f"policy={spec}"]) for spec in ("tova", "sink")]
    outcomes = run_group([(cfg, tmp_path / str(number)) for number, cfg in enumerate(cfgs)])
    assert all(isinstance(outcome, KVBenchError) for outcome in outcomes)
    assert str(outcomes[0]) == str(outcomes[1]) and "too small for RULER" in str(outcomes[0])
    assert load_count[0] == 0


def test_a_group_computes_a_full_cache_once_whatever_its_budgets(tmp_path):
    """``full`` at two budgets in a group sharing its prefills is one computation (``computation_key``): both runs write
    what a run of their own writes, and the shared forward counts two variants (full, snapkv), not three."""
    from kvbench.run import run, run_group

    members = [("full", "32"), ("full", "64"), ("snapkv", "64")]
    cfgs = [compose([*TINY, f"policy={spec}", f"budget={budget}"]) for spec, budget in members]
    run_group([(cfg, tmp_path / "group" / f"{spec}@{budget}") for cfg, (spec, budget) in zip(cfgs, members)], True)
    for cfg, (spec, budget) in zip(cfgs, members):
        run(cfg, tmp_path / "alone" / f"{spec}@{budget}")
        assert outcome(tmp_path / "group" / f"{spec}@{budget}") == outcome(tmp_path / "alone" / f"{spec}@{budget}")
    records = (tmp_path / "group" / "full@64" / "predictions.jsonl").read_text().splitlines()
    assert {json.loads(line)["timing"]["prefill_shared_by"] for line in records} == {2}


def test_a_shared_prefill_computes_each_normalised_sum_once(monkeypatch):
    """In one shared forward H2O's normalised sums are computed once per :func:`sums_key`: ``h2o`` at two budgets,
    ``h2o+caote`` (CAOTE re-weights H2O's sums, it does not replace them) and ``h2o+calidrop`` with PyramidKV's layer
    budgets take one pass a layer, ``h2o+obcache_joint`` (its own sums) another."""
    model, prompt = tiny_model(), random_prompt(100)
    specs = [("h2o", 32), ("h2o", 48), ("h2o+caote", 32), ("h2o+obcache_joint", 32)]
    engines = [Engine(model, build_policy(spec), budget) for spec, budget in specs]
    pyramid = build_policy("h2o+calidrop", {"layer_budget": "pyramid"})  # another layer budget: the same sums
    engines.append(Engine(model, pyramid, 48))
    passes: list[str] = []
    computed = Scorer.normalised_sums

    def counted(scorer, *args):
        passes.append(scorer.policy.spec)
        return computed(scorer, *args)

    monkeypatch.setattr(Scorer, "normalised_sums", counted)
    generate_shared(engines, prompt, 1)
    assert sorted(set(passes)) == ["h2o", "h2o+obcache_joint"] and len(passes) == 2 * engines[0].num_layers


def test_the_sweep_progress_line_counts_samples_and_extrapolates_the_jobs_not_started(monkeypatch):
    """Two of four jobs started with 10 samples each, 5 written in 10 s: 5/40 samples, 0.50 samples/s, 70 s left;
    before any sample is written it says so rather than a time."""
    clock = iter([100.0, 110.0, 110.0])
    monkeypatch.setattr(kvbench.run.progress.time, "monotonic", lambda: next(clock))
    progress = kvbench.run.progress.SweepProgress(jobs=4)
    progress.opened(10)
    progress.opened(10)
    assert progress.line() == (
        "kvbench: sweep: 0/40 samples written, 2/4 jobs started, 0:00:10 in; the first samples' rows are running"
    )
    for _ in range(5):
        progress.written()
    assert progress.line() == (
        "kvbench: sweep: 5/40 samples written, 2/4 jobs started, 0:00:10 in, 0.50 samples/s, about 0:01:10 left"
    )
