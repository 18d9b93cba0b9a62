"""Sampling (``generation.*``): each token drawn from the softmax at a temperature within the top-p nucleus, each
sample from its own seeded generator, so a row draws alike alone, beside others and on a rerun; several draws of a
problem scored by pass@k's unbiased estimator and avg@n."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from kvbench.engine import Engine
from kvbench.engine.rows import decode_rows
from kvbench.engine.sampling import Sampling, draw_seed, seeded
from kvbench.engine.shared import Prompt, prefill_draws
from kvbench.finished import load_runs
from kvbench.identity import run_identity
from kvbench.policies import build_policy
from kvbench.results.leaderboard import leaderboard_tables
from kvbench.run.records import pass_at_k, sampled_scores
from tests.helpers import TOKENIZER, random_prompt, refused, tiny_model
from tests.test_math_tasks import ROWS
from tests.test_qa_task import write_rows


def test_draws_follow_the_softmax_within_the_nucleus():
    """Logits [2, 1, 0, -1]: softmax ≈ [.644, .237, .087, .032]; top_p = 0.7 keeps the first two (the first alone is
    under 0.7), renormalised to [.731, .269]; the others are never drawn."""
    logits, generator = torch.tensor([2.0, 1.0, 0.0, -1.0]), seeded(0)
    draws = [Sampling(top_p=0.7).draw(logits, generator) for _ in range(3000)]
    counts = [draws.count(token) / len(draws) for token in range(4)]
    probs = torch.softmax(logits, dim=-1)
    assert counts[2] == counts[3] == 0 and counts[0] == pytest.approx(float(probs[0] / probs[:2].sum()), abs=0.03)
    everything = [Sampling().draw(logits, generator) for _ in range(3000)]
    assert [everything.count(t) / 3000 for t in range(4)] == pytest.approx(probs.tolist(), abs=0.03)
    cold = [Sampling(temperature=0.05).draw(logits, generator) for _ in range(200)]
    assert set(cold) == {0}  # a temperature near 0 is greedy


def test_a_seed_is_its_samples_on_every_machine():
    assert (
        draw_seed(3, "gsm8k-0#1") == draw_seed(3, "gsm8k-0#1") != draw_seed(3, "gsm8k-0#2") != draw_seed(4, "gsm8k-0#2")
    )
    assert 0 <= draw_seed(0, "x") < 2**63


def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_correct_draw():
    """The estimator against the brute-force count over every k-subset of the draws."""
    for draws, correct in [(5, 0), (5, 2), (4, 1), (6, 6)]:
        outcomes = [True] * correct + [False] * (draws - correct)
        for k in range(1, draws + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert pass_at_k(draws, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_sampled_scores_over_problems():
    records = [{"problem": "a", "score": s} for s in (1.0, 0.0, 0.0, 0.0)]
    records += [{"problem": "b", "score": s} for s in (1.0, 1.0, 0.0, 0.0)]
    scores = sampled_scores(records)
    intervals = scores.pop("intervals")
    assert scores == pytest.approx(
        {"pass@1": 37.5, "pass@2": 100 * (0.5 + (1 - 1 / 6)) / 2, "pass@4": 100.0, "avg@4": 37.5}
    )
    # two problems resampled whole: each interval spans the two problems' own values (25 and 50 for pass@1)
    expected = {"pass@1": [25, 50], "pass@2": [50, 100 * (1 - 1 / 6)], "pass@4": [100, 100], "avg@4": [25, 50]}
    assert intervals == {name: pytest.approx(bounds) for name, bounds in expected.items()}
    assert sampled_scores([{"id": "x", "score": 1.0}]) == {}


def engine(spec: str, sampling: Sampling | None, model=None) -> Engine:
    return Engine(
        model or tiny_model(), build_policy(spec, {}), 48, regime="streaming", tokenizer=TOKENIZER, sampling=sampling
    )


def seeded_row(runner: Engine, prompt: list[int], seed: int):
    row = runner.prefilled_row(prompt, 12)
    row.seed = seed
    return row


def test_rows_draw_alike_alone_and_together_and_a_tiny_nucleus_is_greedy():
    """Rows of three seeds (two engines) decoded together draw the tokens each draws alone; other seeds draw other
    tokens; top_p → 0 keeps the likeliest token alone: greedy decoding's tokens."""
    model, prompt = tiny_model(), random_prompt(80)
    sampling = Sampling(temperature=1.5, top_p=0.95, seed=0)
    runners = [engine("h2o", sampling, model), engine("snapkv", sampling, model)]
    seeds = [11, 12, 13]
    together = decode_rows([seeded_row(r, prompt, s) for r in runners for s in seeds], 6)
    alone = [decode_rows([seeded_row(r, prompt, s)], 1)[0] for r in runners for s in seeds]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together[:3]}) > 1  # the seeds draw differently
    greedy = engine("h2o", None, model).generate(prompt, 12).token_ids
    assert decode_rows([seeded_row(engine("h2o", Sampling(top_p=1e-9), model), prompt, 5)], 1)[0].token_ids == greedy


@pytest.mark.parametrize("regime", ["streaming", "oneshot"])
def test_the_draws_of_one_prefill_draw_what_each_draws_prefilled_alone(regime):
    """Three draws of one prompt from one prefill per engine (:func:`prefill_draws`): each draw's tokens, cache sizes
    and policy statistics equal those of its draw from a prefill of its own, so each draw decodes a cache of its own;
    the prefill's time is divided among the draws."""
    model, prompt = tiny_model(), random_prompt(80)
    sampling = Sampling(temperature=1.5, top_p=0.95, seed=0)
    runners = [
        Engine(model, build_policy(spec, {}), 48, regime=regime, tokenizer=TOKENIZER, sampling=sampling)
        for spec in ("h2o", "snapkv+caote", "rkv")
    ]
    seeds = [11, 12, 13]
    rows = prefill_draws(runners, Prompt(prompt, 12), len(seeds), batch_size=4)
    assert [row.context_shared_by for row in rows] == [3] * 9
    for place, row in enumerate(rows):  # draw by draw, an engine's row each
        row.seed = seeds[place // len(runners)]
    shared = decode_rows(rows, 5)
    alone = [decode_rows([seeded_row(r, prompt, s)], 1)[0] for s in seeds for r in runners]
    assert [o.token_ids for o in shared] == [o.token_ids for o in alone]
    assert [(o.kv, o.policy_stats, o.kv_curve) for o in shared] == [(o.kv, o.policy_stats, o.kv_curve) for o in alone]
    assert len({tuple(o.token_ids) for o in shared[:: len(runners)]}) > 1  # the draws differ


def test_many_draws_are_made_as_the_batch_frees_from_one_prefill(tmp_path, monkeypatch):
    """Five draws of each problem at ``engine.batch_size=2``, two policies in a sweep: each problem prefilled once for
    both, its draws' caches copied one draw (two rows) at a time as rows leave the batch (not five at once), and the
    records those of the draws made all at once (``engine.batch_size=10``)."""
    from kvbench.cli import main
    from kvbench.engine import shared

    prefills, takes = [], []
    prefill, take = shared.prefill_shared, shared.Draws.take
    monkeypatch.setattr(shared, "prefill_shared", lambda *args: prefills.append(1) or prefill(*args))
    monkeypatch.setattr(shared.Draws, "take", lambda draws, count: takes.append(count) or take(draws, count))
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    common = ["model=tiny_llama", "task=gsm8k", f"task.path={path}", "task.prompt_format=raw", "task.max_new_tokens=5"]
    common += ["budget=96", "generation.do_sample=true", "generation.num_samples=5", "policy=h2o,tova"]
    for batch in (2, 10):
        main(["run", "-m", *common, f"engine.batch_size={batch}", f"hydra.sweep.dir={tmp_path / str(batch)}"])
        assert len(prefills) == 2 and max(takes) == batch // 2  # a problem's prefill for both; a take's rows fit
        prefills.clear(), takes.clear()
    for policy in ("h2o", "tova"):
        (small,) = (tmp_path / "2").glob(f"**/{policy}-*/predictions.jsonl")
        (large,) = (tmp_path / "10").glob(f"**/{policy}-*/predictions.jsonl")
        drop_time = [{**json.loads(line), "timing": None} for line in small.read_text().splitlines()]
        assert drop_time == [{**json.loads(line), "timing": None} for line in large.read_text().splitlines()]
        assert len(drop_time) == 10


def test_generation_at_its_defaults_names_the_runs_it_always_named():
    """The generation node at its defaults leaves a run's identity as it was before the node (committed runs keep
    their directories); a sampling setting changes it."""
    settings = {"model": {"name": "m"}, "engine": {"regime": "oneshot"}, "seed": 0}
    defaults = {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "num_samples": 1, "seed": 0}
    assert run_identity({**settings, "generation": defaults}) == run_identity(settings)
    assert run_identity({**settings, "generation": {**defaults, "do_sample": True}})["generation"] == {
        "do_sample": True
    }


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("generation.num_samples=4", "generation.num_samples=4 draws as many traces of a problem, which greedy"),
        ("generation.temperature=0", "generation.temperature=0: must be a number > 0"),
        ("generation.top_p=1.5", "generation.top_p=1.5: must be a number in (0, 1]"),
        ("generation.sead=1", "unknown key generation.sead for generation; valid keys: do_sample, temperature, top_p"),
    ],
)
def test_bad_generation_settings_are_one_line(override, message, capsys, tmp_path):
    run = ["run", "model=tiny_llama", override, f"output_dir={tmp_path / 'run'}"]
    assert message in refused(capsys, run, tmp_path / "run")


def test_a_sampled_sweep_draws_alike_grouped_alone_and_rerun(tmp_path):
    """``generation.num_samples=3`` on two problems: three records a problem (``<id>#<k>``, its problem and draw),
    pass@1/pass@2/pass@3 and avg@3 in metrics.json; a grouped sweep of two policies draws what each policy's run
    alone draws, and a rerun the same."""
    from kvbench.cli import main

    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    common = ["model=tiny_llama", "task=gsm8k", f"task.path={path}", "task.prompt_format=raw", "task.max_new_tokens=6"]
    common += ["budget=96", "engine.regime=streaming", "generation.do_sample=true", "generation.num_samples=3"]
    common += ["generation.seed=3", "generation.temperature=0.6"]
    main(["run", "-m", *common, "policy=h2o,snapkv", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    for policy in ("h2o", "snapkv"):
        main(["run", *common, f"policy={policy}", f"output_dir={tmp_path / policy}"])
    (grouped_h2o,) = (tmp_path / "sweep").glob("**/h2o-*/predictions.jsonl")

    def predictions(file) -> dict[str, str]:
        return {r["id"]: r["prediction"] for r in map(json.loads, file.read_text().splitlines())}

    alone = predictions(tmp_path / "h2o" / "predictions.jsonl")
    assert alone == predictions(grouped_h2o) and len(alone) == 6
    assert sorted(alone) == [f"gsm8k-{p}#{k}" for p in range(2) for k in range(3)]
    records = [json.loads(line) for line in (tmp_path / "h2o" / "predictions.jsonl").read_text().splitlines()]
    assert [(r["problem"], r["draw"]) for r in records] == [(f"gsm8k-{p}", k) for p in range(2) for k in range(3)]
    assert {r["timing"]["context_shared_by"] for r in records} == {3}  # a problem's draws share its prefill
    prompts = sum({r["problem"]: r["prompt_tokens"] for r in records}.values())  # each problem's prompt once
    assert f"(new run, 6 to go: {prompts} prompt tokens)" in (tmp_path / "h2o" / "kvbench.log").read_text()
    generation = json.loads((tmp_path / "h2o" / "metrics.json").read_text())["generation"]
    assert set(generation) == {
        "mean_generated_tokens",
        "stopped_share",
        "pass@1",
        "pass@2",
        "pass@3",
        "avg@3",
        "intervals",
    }
    assert set(generation["intervals"]) == {"pass@1", "pass@2", "pass@3", "avg@3"}
    main(["run", *common, "policy=h2o", f"output_dir={tmp_path / 'again'}"])
    assert predictions(tmp_path / "again" / "predictions.jsonl") == alone
    assert not math.isnan(generation["avg@3"])
    # the leaderboard resamples whole problems: one problem's three draws right, the other's wrong, is two values
    scored = [{**record, "score": float(record["problem"] == "gsm8k-0")} for record in records]
    (tmp_path / "h2o" / "predictions.jsonl").write_text("".join(json.dumps(record) + "\n" for record in scored))
    (cell,) = leaderboard_tables(load_runs([tmp_path / "h2o"]))["leaderboard_cells"].itertuples()
    assert (cell.n, cell.mean, cell.low, cell.high) == (6, 50.0, 0.0, 100.0)  # six independent draws: low 1/6
