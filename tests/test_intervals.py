"""Bootstrap intervals (:mod:`kvbench.results.intervals`) against a brute-force loop and known cases, and the
leaderboard built from them (:mod:`kvbench.results.leaderboard`)."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from kvbench import PROJECT_ROOT
from kvbench.cli import main
from kvbench.config import compose
from kvbench.finished import load_runs
from kvbench.policies import BASES, MODIFIERS
from kvbench.results import intervals
from kvbench.results.intervals import Interval, bootstrap_mean, paired_difference
from kvbench.results.leaderboard import leaderboard_tables
from kvbench.run import run
from tests.helpers import VARIANTS, refused
from tests.test_groups import TINY


def test_the_interval_is_the_quantiles_of_the_resampled_means():
    """The vectorised resampling equals a loop over the same draws, resample by resample."""
    values = np.random.default_rng(3).normal(size=37)
    interval = bootstrap_mean(values, resamples=500, seed=11)
    draws = np.random.default_rng(11).integers(0, 37, size=(500, 37))
    means = [sum(values[index] for index in row) / 37 for row in draws]
    assert interval.low == pytest.approx(np.quantile(means, 0.025), abs=1e-12)
    assert interval.high == pytest.approx(np.quantile(means, 0.975), abs=1e-12)
    assert interval.mean == pytest.approx(values.mean()) and interval.n == 37
    assert bootstrap_mean(values, resamples=500, seed=11) == interval  # the same seed, the same interval
    # other values of the same size read the same draws (cached, read-only), as a fresh generator makes them
    others = values[::-1] * 2.0
    means = [sum(others[index] for index in row) / 37 for row in draws]
    assert bootstrap_mean(others, resamples=500, seed=11).low == pytest.approx(np.quantile(means, 0.025), abs=1e-12)
    assert not intervals.draws(11, 37, 500).flags.writeable


def test_resamples_drawn_and_averaged_in_blocks_are_those_of_one_draw():
    """More resamples than a block (and a last block cut short): the draws are numpy's single draw's, held in the
    smallest type that fits, and the interval is the one the whole ``[R,n]`` matrix gives, bit for bit, with and
    without clusters."""
    resamples, size = 2 * intervals.BLOCK + 7, 301
    whole = np.random.default_rng(4).integers(0, size, size=(resamples, size))  # [R,n]
    drawn = intervals.draws(4, size, resamples)
    quantiles = [(1 - intervals.LEVEL) / 2, (1 + intervals.LEVEL) / 2]  # as bootstrap_mean reads them
    assert drawn.dtype == np.uint16 and np.array_equal(drawn, whole)
    values = np.random.default_rng(6).normal(size=size)
    low, high = np.quantile(values[whole].mean(axis=1), quantiles)
    interval = bootstrap_mean(values, resamples=resamples, seed=4)
    assert (interval.low, interval.high) == (low, high)
    clusters = [str(index % 9) for index in range(size)]  # 9 clusters of 33–34 values
    _, of = np.unique(clusters, return_inverse=True)
    sums, sizes = np.bincount(of, weights=values), np.bincount(of)
    drawn = np.random.default_rng(4).integers(0, 9, size=(resamples, 9))
    low, high = np.quantile(sums[drawn].sum(axis=1) / sizes[drawn].sum(axis=1), quantiles)
    interval = bootstrap_mean(values, resamples=resamples, seed=4, clusters=clusters)
    assert (interval.low, interval.high) == (low, high)


def test_the_interval_has_the_width_of_the_normal_one_for_many_samples():
    """For 400 normal samples the 95 % interval is mean ± 1.96 σ/√n to within a few percent."""
    values = np.random.default_rng(5).normal(loc=2.0, scale=3.0, size=400)
    interval = bootstrap_mean(values)
    half = 1.96 * values.std() / np.sqrt(values.size)
    assert (interval.high - interval.low) / 2 == pytest.approx(half, rel=0.05)
    assert interval.low < values.mean() < interval.high


def test_constant_scores_have_no_spread_and_a_paired_shift_is_exact():
    """Identical scores give a zero-width interval; a method that scores every sample 1 higher differs by exactly
    1; only the samples both methods scored are paired."""
    assert bootstrap_mean([0.5] * 10) == Interval(0.5, 0.5, 0.5, 10)
    base = {f"s{i}": float(i % 3) for i in range(50)}
    shifted = {key: value + 1.0 for key, value in base.items()}
    difference = paired_difference({**shifted, "extra": 9.0}, base)
    assert difference == Interval(1.0, 1.0, 1.0, 50) and difference.excludes_zero
    same = paired_difference(base, base)
    assert same == Interval(0.0, 0.0, 0.0, 50) and not same.excludes_zero


def test_pairing_sees_a_difference_that_unpaired_intervals_overlap():
    """Scores that vary a lot between samples but move together: the two cells' intervals overlap, the paired
    difference excludes zero (why the leaderboard compares a modifier with its base sample by sample)."""
    rng = np.random.default_rng(7)
    hardness = rng.normal(scale=10.0, size=100)
    base = {f"s{i}": float(h) for i, h in enumerate(hardness)}
    better = {key: value + 1.0 + rng.normal(scale=0.5) for key, value in base.items()}
    one, other = bootstrap_mean(list(base.values())), bootstrap_mean(list(better.values()))
    assert one.high > other.low  # the unpaired intervals overlap
    assert paired_difference(better, base).low > 0.5


def test_a_clustered_interval_resamples_whole_clusters():
    """With clusters, the vectorised resampling equals a loop drawing whole clusters (clusters in sorted order), each
    resample's mean over the samples drawn; questions that share a context and move together widen the interval
    against treating them as independent, and a paired difference is clustered by the sample ids' clusters."""
    rng = np.random.default_rng(4)
    contexts = [f"c{i}" for i in range(25) for _ in range(4)]
    values = np.repeat(rng.normal(scale=10.0, size=25), 4) + rng.normal(scale=0.5, size=100)
    interval = bootstrap_mean(values, resamples=400, seed=2, clusters=contexts)
    names = sorted(set(contexts))
    members = {name: [value for value, of in zip(values, contexts) if of == name] for name in names}
    draws = np.random.default_rng(2).integers(0, 25, size=(400, 25))
    means = [np.mean([value for index in row for value in members[names[index]]]) for row in draws]
    assert interval.low == pytest.approx(np.quantile(means, 0.025), abs=1e-9)
    assert interval.high == pytest.approx(np.quantile(means, 0.975), abs=1e-9)
    assert interval.mean == pytest.approx(values.mean()) and interval.n == 100
    independent = bootstrap_mean(values)
    clustered = bootstrap_mean(values, clusters=contexts)
    assert clustered.high - clustered.low > 1.5 * (independent.high - independent.low)
    ids = {f"q{i}": float(value) for i, value in enumerate(values)}
    zero = {key: 0.0 for key in ids}
    by_context = {f"q{i}": context for i, context in enumerate(contexts)}
    assert paired_difference(ids, zero, clusters=by_context) == clustered


def test_no_samples_is_an_error():
    with pytest.raises(ValueError):
        bootstrap_mean([])
    with pytest.raises(ValueError):
        paired_difference({"a": 1.0}, {"b": 1.0})


def test_the_leaderboard_gives_each_cell_its_interval_and_each_modifier_its_paired_difference(tmp_path, capsys):
    """Runs of a base, a modifier of it and the full cache: one cell each with n, the mean of ``metrics.json``'s score
    and an interval around it; one paired row (the modifier against its base, on the same samples), none for the
    full cache; the tables written with ``--output-dir``."""
    for spec in ("snapkv", "snapkv+caote", "full"):
        run(compose([*TINY, "task.num_samples=4", f"policy={spec}", "budget=64"]), tmp_path / "runs" / spec)
    main(["leaderboard", str(tmp_path / "runs"), "--output-dir", str(tmp_path / "tables")])
    printed = capsys.readouterr().out
    assert "### leaderboard_cells" in printed and "### leaderboard_paired" in printed
    main(["leaderboard", str(tmp_path / "runs"), "--format", "csv"])
    assert "policy,budget,n,mean,low,high" in capsys.readouterr().out
    tables = leaderboard_tables(load_runs([tmp_path / "runs"]))
    cells, paired = tables["leaderboard_cells"], tables["leaderboard_paired"]
    assert sorted(cells["policy"]) == ["full", "snapkv", "snapkv+caote"] and set(cells["n"]) == {4}
    for row in cells.itertuples():
        metrics = json.loads((tmp_path / "runs" / row.policy / "metrics.json").read_text())
        assert row.mean == pytest.approx(metrics["scores"][row.subtask]) and row.low <= row.mean <= row.high
        records = [json.loads(line) for line in (tmp_path / "runs" / row.policy / "predictions.jsonl").open()]
        assert row.generated == pytest.approx(np.mean([record["generated_tokens"] for record in records]))
        assert row.kv_peak_mib == pytest.approx(np.mean([record["kv"]["peak_bytes"] for record in records]) / 2**20)
    assert cells.set_index("policy")["kv_peak_mib"].idxmax() == "full"
    assert list(paired["policy"]) == ["snapkv+caote"] and list(paired["base"]) == ["snapkv"]
    assert paired["n"].iloc[0] == 4 and paired["low"].iloc[0] <= paired["difference"].iloc[0] <= paired["high"].iloc[0]
    assert sorted(path.name for path in (tmp_path / "tables").iterdir()) == [
        "leaderboard.png",
        "leaderboard_cells.md",
        "leaderboard_paired.md",
        "leaderboard_paired_summary_ruler.md",
        "leaderboard_summary_ruler.md",
    ]
    summary, paired_summary = tables["leaderboard_summary_ruler"], tables["leaderboard_paired_summary_ruler"]
    assert list(summary.columns) == ["policy", "n", "–", "64"]  # the constant cell key is left out
    cell = cells[cells["policy"] == "snapkv"].iloc[0]
    expected = f"{cell['mean']:.1f} [{cell['low']:.1f}, {cell['high']:.1f}]"
    assert summary.set_index("policy").loc["snapkv", "64"] == expected
    assert list(paired_summary["policy"]) == ["snapkv+caote"] and paired_summary["64"].iloc[0].startswith(
        f"{paired['difference'].iloc[0]:+.1f} ["
    )


@pytest.mark.model
def test_runs_with_nothing_to_pair_print_no_empty_paired_table(tmp_path, capsys):
    """Two bases and no ``--baseline``: the cells, no empty paired table under its header, one line saying why."""
    for spec in ("snapkv", "tova"):
        run(compose([*TINY, "task.num_samples=2", f"policy={spec}", "budget=64"]), tmp_path / "runs" / spec)
    main(["leaderboard", str(tmp_path / "runs")])
    printed = capsys.readouterr()
    assert "### leaderboard_cells" in printed.out and "leaderboard_paired" not in printed.out
    assert "nothing paired (no modifier beside its base at a budget in these runs)" in printed.err


def test_make_leaderboard_smoke(tmp_path):
    """``make leaderboard SCALE=smoke``: the grouped sweep on SmolLM2, then every cell with its interval, the paired
    comparisons, the plot and the provenance; run again (its RULER sweep: each sweep's finished runs are found alike),
    it finds every run finished and rewrites the same tables, its provenance still counting the first invocation's
    sample seconds."""
    command = ["make", "-o", ".venv/.installed", "leaderboard", "SCALE=smoke", f"LEADERBOARD_DIR={tmp_path}"]
    sample_seconds = []
    for again in ([], ["LEADERBOARD_SWEEPS=leaderboard"]):
        done = subprocess.run([*command, *again], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not again or "10 jobs, 10 skipped (10 finished, 0 running), 0 submitted" in done.stdout
        report = tmp_path / "report"
        cells = (report / "leaderboard_cells.md").read_text()
        assert (report / "leaderboard.png").stat().st_size > 0
        sample_seconds.append(json.loads((report / "provenance.json").read_text())["sample_seconds"])
    assert sample_seconds[0] > 0 and sample_seconds[1] == sample_seconds[0]
    # RULER: the full cache once, 4 policies × 2 budgets; the needle grid and perplexity: the full cache, 2 policies;
    # RULER query-agnostic: the full cache and SnapKV, and KVzip head-wise (its own cell, kvzip[headwise])
    assert cells.count("| smollm2_135m |") == (1 + 4 * 2) + 3 + 3 + 2 + 1
    assert "| ruler-agnostic |" in cells and "| kvzip[headwise] " in cells
    assert "| perplexity |" in cells and "| niah " in cells
    paired = (report / "leaderboard_paired.md").read_text()
    assert re.search(r"\| snapkv\+obcache_joint +\| snapkv +\|", paired) and re.search(
        r"\| h2o\+caote +\| h2o +\|", paired
    )
    made = json.loads((report / "provenance.json").read_text())
    assert made["command"] == "make leaderboard SCALE=smoke"
    assert made["runs"] == 10 + 3 + 3 + 2 + 1 and made["samples"] == 20 + 6 + 6 + 4 + 2
    assert made["wall_seconds"] > 0 and made["versions"]["torch"] and made["commit"]


def test_make_leaderboard_smoke_on_another_model(tmp_path):
    """``make leaderboard SCALE=smoke MODEL=tiny_qwen3``: the leaderboard's sweeps on a tiny Qwen3 (the command line's
    model over the experiments' SmolLM2), every cell that model's, the provenance naming it. Two of the sweeps (each
    passes the model alike; the test above runs all five): perplexity's, and the head-wise one's RULER."""
    command = ["make", "-o", ".venv/.installed", "leaderboard", "SCALE=smoke", "MODEL=tiny_qwen3"]
    sweeps = "LEADERBOARD_SWEEPS=leaderboard_ppl leaderboard_headwise"
    done = subprocess.run(
        [*command, sweeps, f"LEADERBOARD_DIR={tmp_path}"], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cells = (tmp_path / "report" / "leaderboard_cells.md").read_text()
    assert cells.count("| tiny_qwen3 |") == 3 + 1 and "smollm2" not in cells
    made = json.loads((tmp_path / "report" / "provenance.json").read_text())
    assert made["command"] == "make leaderboard SCALE=smoke MODEL=tiny_qwen3" and made["runs"] == 3 + 1


@pytest.fixture(scope="module")
def committed_runs():
    """``results/leaderboard``'s runs, loaded once for the tests that read them (``load_runs``)."""
    committed = PROJECT_ROOT / "results" / "leaderboard"
    if not committed.is_dir():
        pytest.skip("results/leaderboard is absent")
    return load_runs([committed])


def test_the_committed_leaderboard_regenerates_its_report_and_the_results_page(tmp_path, capsys, committed_runs):
    """``results/leaderboard``'s run directories give its report's tables byte for byte, and the README's results
    pages (docs/results*.md) quote the summaries as they are (``kvbench leaderboard results/leaderboard``)."""
    committed = PROJECT_ROOT / "results" / "leaderboard"
    if not (committed / "report").is_dir():
        pytest.skip("results/leaderboard has no report")
    main(["leaderboard", str(committed), "--output-dir", str(tmp_path)])
    readme = "\n".join(page.read_text() for page in sorted((PROJECT_ROOT / "docs").glob("results*.md")))
    names = sorted(path.stem for path in tmp_path.glob("*.md"))
    assert names == sorted(path.stem for path in (committed / "report").glob("*.md"))
    assert [f"leaderboard_summary_{task}" in names for task in ("niah", "ppl", "ruler")] == [True] * 3
    for name in names:
        made = (tmp_path / f"{name}.md").read_text()
        assert made == (committed / "report" / f"{name}.md").read_text(), name
        if "summary" in name:
            assert made.strip() in readme, f"no docs/results*.md page quotes {name}.md"
    tables = leaderboard_tables(committed_runs)
    assert (tables["leaderboard_cells"]["n"] >= 100).all() and (tables["leaderboard_paired"]["n"] >= 100).all()
    assert "kv_peak_mib" in tables["leaderboard_cells"] and "generated" not in tables["leaderboard_cells"]  # older runs


def test_perplexity_cells_keep_their_scale(tmp_path):
    """A perplexity run's cells are its windows' perplexities as they are (not ×100), marked ``perplexity``; a modifier
    is compared with its base on the same windows; the plot draws them on their own axis."""
    text = tmp_path / "book.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40)
    for spec in ("h2o", "h2o+caote"):
        settings = ["model=tiny_llama", "task=ppl", f"task.path={text}", "task.max_tokens=64", "task.num_samples=3"]
        run(compose([*settings, "engine.regime=streaming", f"policy={spec}", "budget=16"]), tmp_path / "runs" / spec)
    tables = leaderboard_tables(load_runs([tmp_path / "runs"]))
    cells, paired = tables["leaderboard_cells"], tables["leaderboard_paired"]
    assert set(cells["metric"]) == {"perplexity"} and set(cells["n"]) == {3}
    for row in cells.itertuples():
        records = [json.loads(line) for line in (tmp_path / "runs" / row.policy / "predictions.jsonl").open()]
        assert row.mean == pytest.approx(np.mean([record["score"] for record in records]))
    assert list(paired["policy"]) == ["h2o+caote"] and paired["n"].iloc[0] == 3
    main(["leaderboard", str(tmp_path / "runs"), "--output-dir", str(tmp_path / "tables")])
    assert (tmp_path / "tables" / "leaderboard.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("experiment", "decoding_only"),
    [("leaderboard", ()), ("leaderboard_needle", ()), ("leaderboard_ppl", ("calidrop", "slake"))],
)
def test_the_leaderboard_runs_every_base_with_every_modifier_that_applies(experiment, decoding_only):
    """Each of the leaderboard's sweeps asks the registry for its policies (``${policies:...}``, no method named by
    hand, so a new method file joins it): the full cache and every base alone and with every modifier that applies to
    it, but a method defined only query-agnostically (KVzip); perplexity, read without decoding, leaves out the
    modifiers that act only on decoding steps and those a chunked read does not define (AdaKV). The query-agnostic
    sweep holds every base alone and head-wise, and such a method with its modifiers."""
    from omegaconf import OmegaConf

    from kvbench.config import defined
    from kvbench.launch.sweeps import sweeper_params

    raw = OmegaConf.load(PROJECT_ROOT / "conf" / "experiment" / f"{experiment}.yaml").hydra.sweeper.params
    assert OmegaConf.to_container(raw)["policy"].startswith("${policies:variants")
    parts = {**BASES, **MODIFIERS}
    swept = [  # the full cache included; a method whose cells are being run (swept = False) not yet
        spec for spec in VARIANTS if all(parts[name].swept for name in spec.split("+"))
    ]
    regimes = ["chunked"] if experiment == "leaderboard_ppl" else None  # perplexity reads its blocks chunked
    expected = [spec for spec in swept if spec.partition("+")[2] not in decoding_only and defined(spec, False, regimes)]
    assert sorted(sweeper_params(experiment)["policy"].split(",")) == sorted(expected)
    only_agnostic = [spec for spec in swept if not defined(spec.partition("+")[0], False)]
    headwise = [spec for spec in swept if "+" in spec and MODIFIERS[spec.partition("+")[2]].shares_heads]
    agnostic = [spec for spec in swept if "+" not in spec] + [spec for spec in only_agnostic if "+" in spec]
    agnostic += [spec for spec in headwise if spec not in agnostic and defined(spec, True)]
    assert "kvzip+calidrop" in only_agnostic and "kvzip" not in expected
    assert sorted(sweeper_params("leaderboard_agnostic")["policy"].split(",")) == sorted(agnostic)


def test_the_registry_expands_a_sweep_and_a_new_method_joins_it(monkeypatch):
    """``${policies:bases}``, ``${policies:variants}`` and ``${policies:variants,prefill}`` read the registry at the
    time the sweep is expanded: a method registered later is in them; a bad kind is one line naming the choices;
    ``headwise`` and ``bases+headwise`` bring the head-wise variants, which a chunked sweep (REGIME) leaves out."""
    from dataclasses import dataclass

    from kvbench.config import registered_policies
    from kvbench.errors import KVBenchError
    from kvbench.policies import registry
    from kvbench.policies.methods.adakv import AdaKV
    from kvbench.policies.methods.sink import Sink

    @dataclass
    class Newest(Sink):
        name = "newest"

    monkeypatch.setitem(registry.BASES, "newest", Newest)
    assert registered_policies("bases").split(",")[-1] == "newest"
    variants = registered_policies("variants").split(",")
    assert {"newest", "newest+calidrop", "newest+slake"} <= set(variants) and "newest+caote" not in variants
    assert "newest+calidrop" not in registered_policies("variants", "prefill").split(",")
    with pytest.raises(
        KVBenchError, match="unknown registered policies 'everything'; valid choices: bases, headwise, variants"
    ):
        registered_policies("everything")
    monkeypatch.setattr(AdaKV, "swept", True)  # the head-wise variants, defined oneshot only
    assert "snapkv+adakv" in registered_policies("headwise").split(",")
    assert {"snapkv", "snapkv+adakv"} <= set(registered_policies("bases+headwise", "decoding", "agnostic").split(","))
    assert "snapkv+adakv" not in registered_policies("variants", "prefill", "aware", "chunked").split(",")


def test_a_baseline_pairs_every_policy_with_it_on_the_same_samples(capsys, committed_runs):
    """``--baseline snapkv`` on the committed leaderboard: every other policy (modifiers of other bases, other bases,
    the full cache) against SnapKV at the same budget, each difference the paired one of the same two cells; a policy
    the runs do not hold is refused in one line."""
    committed, runs = PROJECT_ROOT / "results" / "leaderboard", committed_runs
    paired = leaderboard_tables(runs, baseline="snapkv")["leaderboard_paired"]
    assert set(paired["base"]) == {"snapkv"} and "snapkv" not in set(paired["policy"])
    assert {"tova", "h2o+caote", "snapkv+caote"} <= set(paired["policy"])
    by_base = leaderboard_tables(runs)["leaderboard_paired"]
    mine = paired.set_index(["task", "subtask", "policy", "budget"])["difference"]
    theirs = by_base[by_base["base"] == "snapkv"].set_index(["task", "subtask", "policy", "budget"])["difference"]
    assert len(theirs) > 0 and (mine.loc[theirs.index] == theirs).all()  # snapkv+X against snapkv: the same pairs
    error = refused(capsys, ["leaderboard", str(committed), "--baseline", "snapkvv"])
    assert "baseline policy (--baseline) 'snapkvv'" in error


def test_the_provenance_reads_the_installed_versions_without_importing_them():
    """``provenance.json``'s versions are the installed distributions' (the ones imported where a run imports them),
    None for a package no distribution names."""
    import torch
    import transformers

    from kvbench.results.leaderboard import installed

    assert installed("torch") == torch.__version__ and installed("transformers") == transformers.__version__
    assert installed("no-such-distribution") is None
