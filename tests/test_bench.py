"""``kvbench bench`` on a tiny model: the JSON layout, and every headline figure recomputed from the raw
repetitions and rows stored beside it (no wall-clock assertions)."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT
from kvbench.bench.measure import PRELOADED, ByFrame, Clock, Operators, PeakMemory, fresh_process, rotations
from kvbench.bench.report import prefill_limit, targets
from kvbench.bench.sections import PARAGRAPH, prompt_tokens
from kvbench.bench.settings import check_bench
from kvbench.cli import main
from kvbench.models import load_tokenizer, model_config
from tests.helpers import refused

TINY = [
    "model=tiny_llama",
    "budget=64",
    "bench.repetitions=3",
    "bench.warmup_tokens=0",
    "bench.prompt_source=paragraph",
    "bench.prefill.policies=[sink,snapkv,h2o+obcache_joint]",
    "bench.prefill.prompt_lengths=[96,160]",
    "bench.prefill.profile=[h2o+obcache_joint]",
    "bench.prefill.profile_rows=5",
    "bench.decode.prompt_lengths=[96,160]",
    "bench.decode.new_tokens=3",
    "bench.memory.policies=[full,snapkv]",
    "bench.memory.prompt_lengths=[96,160]",
    "bench.memory.new_tokens=2",
    "bench.generate.prompt_lengths=[32]",
    "bench.generate.new_tokens=4",
    "bench.kvpress.prompt_length=160",
    "bench.grid.context_length=512",
    "bench.grid.num_samples=1",
    "bench.grid.policies=[h2o,snapkv]",
    "bench.grid.budgets=[64]",
    "bench.grid.rows=3",
    "bench.grid.new_tokens=4",
    "bench.contexts.context_length=1024",
    "bench.contexts.questions=2",
    "bench.contexts.policies=[h2o,snapkv]",
    "bench.contexts.budgets=[64]",
    "bench.contexts.new_tokens=4",
    "bench.headwise.prompt_length=160",
    "bench.headwise.new_tokens=3",
    "bench.grid_operators.context_length=256",
    "bench.grid_operators.budgets=[20pct]",
    "bench.grid_operators.profile_rows=4",
]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One tiny benchmark run with kvpress made unimportable; its ``bench.json`` and output folder."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "kvpress", None)
        main(["bench", *TINY, f"output_dir={out}"])
    return json.loads((out / "bench.json").read_text()), out


def bench_md(out: Path) -> str:
    """``bench.md`` with its tables' padding collapsed (pandas aligns the columns): ``| a | b |`` for each row."""
    return re.sub(r" {2,}", " ", (out / "bench.md").read_text())


def test_json_has_the_required_keys(bench):
    results, out = bench
    required = {"prefill_overhead", "decode_latency_ratio", "harness_vs_generate", "kv_bytes", "memory", "kvpress"}
    assert required | {"raw", "machine", "targets", "config"} <= set(results)
    assert set(results["prefill_overhead"]) == {"sink", "snapkv", "h2o+obcache_joint"}
    assert all(set(by_length) == {"96", "160"} for by_length in results["prefill_overhead"].values())
    assert {"platform", "cpu_count", "torch", "transformers", "device"} <= set(results["machine"])
    assert results["kvpress"]["skipped"].startswith("kvpress is not importable")
    markdown = bench_md(out)
    assert "| policy | 96 tokens | 160 tokens |" in markdown and "skipped: kvpress" in markdown


def test_ratios_are_positive(bench):
    results, _ = bench
    ratios = [ratio for by_length in results["prefill_overhead"].values() for ratio in by_length.values()]
    ratios += [ratio for by_length in results["prefill_overhead_cpu"].values() for ratio in by_length.values()]
    assert all(isinstance(ratio, float) and ratio > 0 for ratio in ratios)
    assert results["decode_latency_ratio"] > 0 and results["harness_vs_generate"] > 0
    full = results["raw"]["prefill"]["full"]["160"]
    assert len(full["wall_seconds"]) == 3 and full["median_wall_seconds"] > 0
    decode = results["raw"]["decode"]
    assert decode["ratio_cpu"] > 0 and len(decode["per_token_seconds"]["160"]["cpu_seconds"]) == 3 * (3 - 1)


def median_ratio(numerator: dict, denominator: dict, clock: str = "wall") -> float:
    """Recomputed from the stored repetitions, not from the stored medians."""
    key = f"{clock}_seconds"
    return statistics.median(numerator[key]) / statistics.median(denominator[key])


def test_prefill_overhead_is_each_policy_over_full(bench):
    results, _ = bench
    raw = results["raw"]["prefill"]
    for spec, by_length in results["prefill_overhead"].items():
        for length, ratio in by_length.items():
            assert ratio == pytest.approx(median_ratio(raw[spec][length], raw["full"][length]))
            cpu = results["prefill_overhead_cpu"][spec][length]
            assert cpu == pytest.approx(median_ratio(raw[spec][length], raw["full"][length], "cpu"))


def test_prefill_operators_count_each_prefill_against_full(bench):
    """Every policy's prefill dispatches what full's does and its scoring on top; a recount of a count matches it."""
    results, out = bench
    counts = results["prefill_operators"]["by_policy"]
    assert results["prefill_operators"]["prompt_length"] == 96
    assert set(counts) == {"full", "sink", "snapkv", "h2o+obcache_joint"}
    for row in counts.values():
        assert row["ratio"] == pytest.approx(row["operators"] / counts["full"]["operators"])
        assert row["ratio"] >= 1.0 and row["host_reads"] >= 0
    assert counts["h2o+obcache_joint"]["ratio"] > counts["sink"]["ratio"]
    with Operators() as counted:
        torch.ones(3).add(1).sum().item()
    assert counted.figures() == {"operators": 4, "host_reads": 1, "host_copies": 0}  # ones, add, sum, the read
    with Operators() as counted:
        torch.ones(3).tolist()  # a host tensor's values (its conjugate and negative bits resolved: nothing to do)
    assert counted.launched == 1  # the ones
    values = torch.arange(4.0)
    with Operators() as counted:
        values.repeat_interleave(2), values.repeat_interleave(torch.tensor([1, 0, 2, 1]))
        values.repeat_interleave(torch.tensor([1, 0, 2, 1]), output_size=4)  # its size given: nothing read
        values[values > 1], values[:, None][torch.tensor([0, 2])]
    assert counted.host_reads == 2  # the counts' and the mask's shapes, not an int's or an index's
    with Operators() as counted:  # the meta device stands for a GPU: a host tensor copied to it is counted
        torch.ones(2).to("meta"), torch.empty(2, device="meta").copy_(torch.ones(2)), torch.ones(2).to("cpu")
    assert counted.host_copies == 2
    ones = torch.ones(3, 4)
    for inference in (False, True):  # under inference mode these reach the mode as themselves: counted by their effect
        with torch.inference_mode(inference), Operators() as counted:
            ones.float(), ones.reshape(12), ones.flatten(), ones.contiguous()  # the tensor itself or a view
        assert counted.launched == 0
        with torch.inference_mode(inference), Operators() as counted:
            ones.double(), ones.t().reshape(12), ones.t().flatten(), ones.t().contiguous(), ones.to("meta")
        assert counted.figures() == {"operators": 5, "host_reads": 0, "host_copies": 1}
    assert "## Operators a prefill of 96 tokens dispatches" in bench_md(out)


def test_operators_by_frame_are_charged_to_the_kvbench_function_that_dispatched_them():
    """``ByFrame`` counts what ``Operators`` counts, each operator and read charged to the innermost kvbench function
    on the stack (``file:function`` under the package), or to ``(model)`` where none is."""
    from kvbench.kernels.decode import padded_regions

    entries = torch.arange(12.0).reshape(6, 2)
    padded_regions(entries, entries, torch.tensor([0, 3]), 2)  # its counting buffer made once a device
    with ByFrame() as counted:
        torch.ones(3).sum().item()
        padded_regions(entries, entries, torch.tensor([0, 3]), 2)
    with Operators() as plain:
        torch.ones(3).sum().item()
        padded_regions(entries, entries, torch.tensor([0, 3]), 2)
    assert counted.figures() == plain.figures()
    assert sum(counted.frames.values()) == counted.launched
    assert counted.frames["(model)"] == 3 and +counted.reads == {"(model)": 1}  # ones, sum, the read
    assert counted.frames["kernels/decode.py:padded_regions"] == counted.launched - 3 > 0


def test_selection_makes_its_slots_on_the_scores_device():
    """The kept slots of a ranked layer are made on the scores' device (meta here, standing for a GPU): no host tensor
    copied there, which on a GPU is a synchronisation at each variant's layer; on CPU they equal the sinks, the recent
    window and the top-ranked slots between them."""
    from kvbench.engine.selection import top_slots

    scores = torch.rand(2, 3, 40)
    with Operators() as counted:
        on_meta = top_slots(scores.to("meta"), 12, 4, 2)
    assert counted.host_copies == 1 and on_meta.shape == (2, 3, 12)  # the scores' own copy only
    kept = top_slots(scores, 12, 4, 2)
    heavy = scores[..., 2:36].topk(6, dim=-1).indices + 2
    expected = torch.cat([heavy, torch.tensor([0, 1, 36, 37, 38, 39]).expand(2, 3, -1)], dim=-1).sort(dim=-1).values
    assert torch.equal(kept, expected)


def test_the_prefill_profile_names_where_the_longest_prefill_goes(bench):
    """``bench.prefill.profile``: the named policies and full, profiled once at the longest prompt: the largest
    operators (on this CPU; kernels on CUDA) by their own time, sorted, each a share of the profile's total."""
    results, out = bench
    profiles = results["prefill_profile"]
    assert profiles["prompt_length"] == 160 and list(profiles["by_policy"]) == ["full", "h2o+obcache_joint"]
    for profile in profiles["by_policy"].values():
        top = profile["top"]
        assert profile["clock"] == "cpu" and len(top) == 5 and profile["total_seconds"] > 0
        assert [row["seconds"] for row in top] == sorted((row["seconds"] for row in top), reverse=True)
        assert all(row["name"].startswith("aten::") and row["calls"] >= 1 for row in top)
        assert sum(row["share"] for row in top) <= 1 + 1e-9
        for row in top:
            assert row["share"] == pytest.approx(row["seconds"] / profile["total_seconds"])
    assert "## Where h2o+obcache_joint's prefill of 160 tokens goes (cpu time" in bench_md(out)


def test_decode_ratio_is_longest_over_shortest_prompt(bench):
    results, _ = bench
    decode = results["raw"]["decode"]
    rows = decode["per_token_seconds"]
    assert results["decode_latency_ratio"] == pytest.approx(median_ratio(rows["160"], rows["96"]))
    assert decode["ratio_cpu"] == pytest.approx(median_ratio(rows["160"], rows["96"], "cpu"))


def test_harness_speed_is_generate_time_over_kvbench_time(bench):
    results, _ = bench
    generate = results["raw"]["generate"]
    rows = generate["per_prompt"].values()
    for clock, key in (("wall", "speed_ratio"), ("cpu", "speed_ratio_cpu")):
        total = {
            variant: sum(statistics.median(row[variant][f"{clock}_seconds"]) for row in rows)
            for variant in ("kvbench", "generate")
        }
        assert generate[key] == pytest.approx(total["generate"] / total["kvbench"])
        for row in rows:
            assert row[key] == pytest.approx(median_ratio(row["generate"], row["kvbench"], clock))
    assert results["harness_vs_generate"] == generate["speed_ratio"]


def test_kv_bytes_are_tokens_times_bytes_per_token(bench):
    results, _ = bench
    layers = 3
    for by_length in results["kv_bytes"].values():
        for length, row in by_length.items():
            per_token_and_layer = row["full_bytes"] / (int(length) * layers)
            assert row["after_prefill_bytes"] == sum(row["after_prefill_tokens_per_layer"]) * per_token_and_layer
            assert row["after_prefill_ratio"] == pytest.approx(row["after_prefill_bytes"] / row["full_bytes"])
            assert row["peak_ratio"] == pytest.approx(row["peak_bytes"] / row["full_bytes"])


def test_memory_growth_is_longest_over_shortest_prompt(bench):
    results, _ = bench
    memory = results["memory"]
    for spec, rows in memory["policies"].items():
        growth, shortest, longest = memory["growth"][spec], rows["96"], rows["160"]
        assert growth["peak_bytes"] == pytest.approx(longest["peak_bytes"] / shortest["peak_bytes"])
        assert growth["peak_rss_delta_bytes"] == pytest.approx(
            longest["peak_rss_delta_bytes"] / shortest["peak_rss_delta_bytes"]
        )
        assert growth["peak_rss_added_bytes"] == longest["peak_rss_delta_bytes"] - shortest["peak_rss_delta_bytes"]


def test_targets_hold_the_figures_they_name(bench):
    results, out = bench
    found = results["targets"]
    assert set(found) == {
        "prefill_overhead[sink]@160",
        "prefill_overhead[snapkv]@160",
        "prefill_overhead[h2o+obcache_joint]@160",
        "decode_latency_ratio",
        "harness_vs_generate",
        "grid_speed_ratio",
        "rows_decode_speed_ratio",
        "stored_rows_spare",
    }
    floors = {"harness_vs_generate", "grid_speed_ratio", "rows_decode_speed_ratio"}
    for name, row in found.items():
        prefill = re.fullmatch(r"prefill_overhead\[(.+)\]@(\d+)", name)
        value = results["prefill_overhead"][prefill[1]][prefill[2]] if prefill else results.get(name)
        value = results["grid"]["speed_ratio"] if name == "grid_speed_ratio" else value
        value = results["grid"]["rows"]["speed_ratio"] if name == "rows_decode_speed_ratio" else value
        stored = results["grid"]["rows"]
        value = stored["stored_peak_bytes"] / stored["stored_reserved_bytes"] if name == "stored_rows_spare" else value
        assert row["value"] == value
        assert row["met"] == (value >= row["limit"] if name in floors else value <= row["limit"])
    assert found["prefill_overhead[sink]@160"]["limit"] == 1.05
    assert found["prefill_overhead[h2o+obcache_joint]@160"]["limit"] == 1.5
    markdown = bench_md(out)
    for spec, by_length in results["prefill_overhead"].items():
        cpu = results["prefill_overhead_cpu"][spec]
        cells = " | ".join(f"{ratio:.3f} ({cpu[n]:.3f})" for n, ratio in by_length.items())
        assert f"| {spec} | {cells} |" in markdown
    assert f"**{results['decode_latency_ratio']:.3f}**" in markdown


def test_eviction_shrinks_the_kv_cache(bench):
    results, _ = bench
    for spec in ("sink", "snapkv", "h2o+obcache_joint"):
        row = results["kv_bytes"][spec]["160"]
        assert row["after_prefill_bytes"] < row["full_bytes"]
        assert row["after_prefill_tokens_per_layer"] == [64, 64, 64]
    full = results["kv_bytes"]["full"]["160"]
    assert full["after_prefill_bytes"] == full["full_bytes"]


def test_memory_section(bench):
    results, _ = bench
    memory = results["memory"]
    assert memory["regime"] == "chunked" and set(memory["policies"]) == {"full", "snapkv"}
    for rows in memory["policies"].values():
        assert all(row["peak_rss_delta_bytes"] > 0 and row["peak_bytes"] > 0 for row in rows.values())
    snapkv = memory["policies"]["snapkv"]
    assert snapkv["160"]["peak_bytes"] < snapkv["160"]["full_bytes"]
    assert memory["growth"]["full"]["peak_bytes"] > memory["growth"]["snapkv"]["peak_bytes"]


def test_generate_comparison_makes_the_same_number_of_tokens(bench):
    results, _ = bench
    generate = results["raw"]["generate"]
    assert generate["new_tokens"] == 4 and generate["same_tokens"] == {"32": True}  # the same tokens, not a key
    assert generate["per_prompt"]["32"]["speed_ratio"] > 0


def test_grid_is_separate_processes_over_one_grouped_sweep(bench):
    """The grid section: each job's own process timed, their sum over the grouped sweep's time, the same
    predictions, and the shared prefill's peak memory beside one job's with its bound."""
    results, out = bench
    grid = results["grid"]
    separate = results["raw"]["grid"]["separate_seconds"]
    assert set(separate) == {"h2o@64", "snapkv@64"} and grid["variants"] == 2 and grid["samples"] == 1
    assert grid["separate_seconds"] == pytest.approx(sum(separate.values()))
    assert grid["speed_ratio"] == pytest.approx(grid["separate_seconds"] / grid["grouped_seconds"])
    assert grid["predictions_equal"] and grid["differing_runs"] == []
    memory = grid["memory"]
    assert memory["one_job"]["variants"] == 1 and memory["grouped"]["variants"] == 2
    bound = memory["one_job"]["peak_rss_delta_bytes"] + memory["grouped"]["other_caches_bytes"]
    assert memory["bound_bytes"] == bound + memory["grouped"]["layer_full_bytes"]
    assert results["targets"]["grid_speed_ratio"]["value"] == grid["speed_ratio"]
    assert "## A grid of 2 jobs × 1 samples" in bench_md(out)
    rows = grid["rows"]
    assert (rows["rows"], rows["new_tokens"], rows["policy"]) == (3, 4, "snapkv@64") and rows["tokens_equal"]
    ratio = rows["rows_tokens_per_second"] / rows["one_row_tokens_per_second"]
    assert rows["speed_ratio"] == pytest.approx(ratio) and rows["padded_tokens_equal"]
    for kind in ("padded", "stored"):
        together = rows[f"{kind}_rows_tokens_per_second"] / rows["one_row_tokens_per_second"]
        assert rows[f"{kind}_speed_ratio"] == pytest.approx(together) and rows[f"{kind}_tokens_equal"]
    assert results["targets"]["rows_decode_speed_ratio"]["value"] == rows["speed_ratio"]
    assert 0 < rows["stored_reserved_bytes"] <= rows["stored_peak_bytes"] < 1.15 * rows["stored_reserved_bytes"]
    assert results["targets"]["stored_rows_spare"]["met"]
    assert rows["memory"]["peak_rss_delta_bytes"] >= 0 and rows["memory"]["rows_cache_peak_bytes"] > 0


def test_grid_operators_count_a_grouped_samples_prefill_and_step_each_alone_and_stored(bench):
    """The grid_operators section: every registered variant at the budget as rows of one prompt; a decode step of the
    rows held together dispatches fewer operators than each attended alone, and reads nothing back."""
    results, out = bench
    counts = results["grid_operators"]
    each, stored = counts["by_attention"]["each"], counts["by_attention"]["stored"]
    assert counts["rows"] > 50 and counts["context_length"] == 256
    assert each["prefill_operators"] == stored["prefill_operators"] > counts["full_row"]["prefill_operators"]
    assert each["prefill_host_copies"] == stored["prefill_host_copies"] == 0  # a CPU has no other device
    assert counts["full_row"]["step_operators"] < stored["step_operators"] < each["step_operators"]
    assert stored["step_host_reads"] == 0
    # the whole decode: the rows joining and leaving the store beside its steps
    assert counts["full_row"]["decode_operators"] < min(stored["decode_operators"], each["decode_operators"])
    assert stored["decode_operators"] > 2 * stored["step_operators"]
    assert f"## Operators of a grouped sample: {counts['rows']} rows of 256 tokens" in bench_md(out)
    profile = stored["step_profile"]  # a step's own: two decodes' difference, over 4
    seconds = [row["seconds"] for row in profile["top"]]
    assert profile["clock"] == "cpu" and len(seconds) == 4 and seconds == sorted(seconds, reverse=True)
    assert 0 < sum(seconds) <= profile["total_seconds"] and all(0 < row["share"] <= 1 for row in profile["top"])
    assert "### Where a step of the stored rows goes (cpu time:" in bench_md(out) and "step_profile" not in each


def test_a_fresh_process_is_another_each_time_with_the_sections_imported_and_none_of_this_ones_memory():
    """The memory rows' processes (:func:`fresh_process`): a new process for each pool, not this one, which starts
    with the bench's sections imported (forked from a server that imported them) and holds none of what this process
    allocated (its resident size below the 1 GiB held here)."""
    held = bytearray(2**30)
    held[:: 2**12] = b"x" * (2**30 // 2**12)  # every page resident
    probe = f"(__import__('os').getpid(), [name in __import__('sys').modules for name in {PRELOADED!r}])"
    resident = "__import__('kvbench.allocator').allocator.status_bytes('VmRSS')"
    found = []
    for _ in range(2):
        with fresh_process() as pool:
            found.append((*pool.submit(eval, probe).result(), pool.submit(eval, resident).result()))
    (first, imported, size), (second, _, _) = found
    assert len({first, second, os.getpid()}) == 3 and all(imported)
    assert size < 2**30 and len(held) == 2**30


def test_a_child_runs_peak_is_its_own_not_the_bench_processes_size(tmp_path):
    """A ``kvbench`` process the bench starts reports its own peak resident bytes (``VmHWM`` as it exits): under a
    parent holding 1 GiB, which a forked child's ``ru_maxrss`` would report at least."""
    from kvbench.bench.grid import run_measured

    held = bytearray(2**30)
    held[:: 2**12] = b"x" * (2**30 // 2**12)  # every page resident
    _, peak = run_measured(["policies"], tmp_path / "kvbench.log")
    assert 0 < peak < 2**30 and len(held) == 2**30


def test_kvpress_agrees_with_kvbench_snapkv(tmp_path):
    pytest.importorskip("kvpress")
    sections = ["bench.prefill.prompt_lengths=[]", "bench.decode.prompt_lengths=[]", "bench.memory.prompt_lengths=[]"]
    sections += ["bench.generate.prompt_lengths=[]", "bench.grid.policies=[]"]
    main(["bench", *TINY, *sections, f"output_dir={tmp_path}"])
    press = json.loads((tmp_path / "bench.json").read_text())["kvpress"]
    assert "skipped" not in press, press.get("skipped")
    assert press["kept_tokens"] == press["kvpress_kept_tokens"] == 64
    assert press["jaccard_mean"] > 0.99


def test_prompt_tokens_have_the_exact_length():
    tokenizer = load_tokenizer(model_config("tiny_llama"))
    for length in (5, len(PARAGRAPH), 3 * len(PARAGRAPH) + 7):
        assert len(prompt_tokens(tokenizer, PARAGRAPH, length)) == length
    assert prompt_tokens(tokenizer, PARAGRAPH, 40) == prompt_tokens(tokenizer, PARAGRAPH, 50)[:40]


def test_rotations_interleave_every_variant_in_every_position():
    orders = [rotations(["a", "b", "c"], repetition) for repetition in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_clock_times_a_callable_and_every_forward():
    import time

    import torch

    clock = Clock(torch.device("cpu"))
    spans: list[float] = []

    def work() -> str:  # the span it ran, by its own clock: the measured wall time holds it
        began = time.perf_counter()
        sum(range(10**5))
        spans.append(time.perf_counter() - began)
        return "done"

    wall, cpu, result = clock.measure(work)
    assert result == "done" and wall >= spans[0] > 0 and cpu >= 0
    layer = torch.nn.Linear(4, 4)
    with clock.forwards(layer) as times:
        for _ in range(3):
            layer(torch.ones(1, 4))
    assert len(times) == 3 and all(seconds >= 0 for pair in times for seconds in pair)


def test_peak_memory_sees_an_allocation():
    import torch

    memory = PeakMemory(torch.device("cpu"))
    if not memory.resettable:
        pytest.skip("no /proc/self/clear_refs: the lifetime peak cannot see one block")
    with memory.track() as figures:
        block = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
        del block
    assert figures["peak_rss_delta_bytes"] >= 15 * 2**20


def test_targets_hold_each_kind_of_policy_to_its_limit():
    results = {
        "prefill_overhead": {
            "snapkv": {"1024": 1.2, "4096": 1.04},
            "snapkv+obcache_value": {"4096": 1.07},
            "snapkv+obcache_joint": {"4096": 1.08},
            "h2o": {"4096": 1.12},
            "h2o+obcache_value": {"4096": 1.4},
        },
        "decode_latency_ratio": 1.2,
        "harness_vs_generate": 0.97,
        "leaderboard_grid": {"sample_cost_ratio": 32.7, "device": "cpu"},
    }
    found = targets(results)
    limits = {name: row["limit"] for name, row in found.items() if name.startswith("prefill")}
    assert limits == {
        "prefill_overhead[snapkv]@4096": 1.05,
        "prefill_overhead[snapkv+obcache_value]@4096": 1.05,
        "prefill_overhead[snapkv+obcache_joint]@4096": 1.10,
        "prefill_overhead[h2o]@4096": 1.10,
        "prefill_overhead[h2o+obcache_value]@4096": 1.5,
    }
    assert [name for name, row in found.items() if not row["met"]] == [
        "prefill_overhead[snapkv+obcache_value]@4096",
        "prefill_overhead[h2o]@4096",
        "decode_latency_ratio",
        "leaderboard_grid_sample_cost_ratio",
    ]
    assert found["leaderboard_grid_sample_cost_ratio"]["limit"] == 6.0
    results["leaderboard_grid"] = {"sample_cost_ratio": 2.9, "device": "cuda"}  # on a GPU, at most 3
    assert targets(results)["leaderboard_grid_sample_cost_ratio"] == {"value": 2.9, "limit": 3.0, "met": True}
    assert "kvpress_speed_ratio" not in found
    on_gpu = {name: row["limit"] for name, row in targets(results, "cuda").items() if "[h2o" in name}
    assert on_gpu == {"prefill_overhead[h2o]@4096": 1.3, "prefill_overhead[h2o+obcache_value]@4096": 1.5}
    assert prefill_limit("h2o+obcache_joint", "cuda") == 1.8 and prefill_limit("h2o+obcache_key") == 1.5


def test_plain_generate_ignores_the_eos_token():
    import torch
    import transformers

    from kvbench.bench.sections import generation_config
    from tests.helpers import tiny_model

    model = tiny_model()
    prompt = torch.tensor([[5, 6, 7, 8] * 10])
    first = model.generate(prompt, max_new_tokens=1, do_sample=False)[0, -1].item()
    model.generation_config.eos_token_id = first
    assert model.generate(prompt, max_new_tokens=6, do_sample=False).shape[1] == 41
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with generation_config(model, config):
        assert model.generate(prompt).shape[1] == 46
    assert model.generation_config.eos_token_id == first


def test_contexts_compress_each_context_once_for_its_questions(bench):
    """The contexts section: agnostic questions of one context answered from one compression per variant against one
    compression per question, the same predictions, the speed ratio recomputed from the raw seconds."""
    results, out = bench
    shared = results["contexts"]
    assert (shared["contexts"], shared["questions"], shared["variants"]) == (2, 4, 2)
    assert shared["compressions"] == {"once_per_context": 4.0, "once_per_question": 8.0}
    assert shared["predictions_equal"]
    raw = results["raw"]["contexts"]["seconds"]
    assert len(raw["once_per_context"]) == len(raw["once_per_question"]) == 2
    assert shared["speed_ratio"] == pytest.approx(sum(raw["once_per_question"]) / sum(raw["once_per_context"]))
    assert "| compressed once per context |" in bench_md(out)


def test_headwise_holds_the_same_bytes_as_the_same_scorer_per_layer(bench):
    """``snapkv+adakv`` against ``snapkv`` at the same budget: the KV bytes after prefill are the same total (the
    entries kept), padding every head to the longest would hold more, and the decode ratio is the medians' ratio."""
    results, out = bench
    headwise, raw = results["headwise"], results["raw"]["headwise"]
    assert headwise["reference"] == "snapkv" and headwise["snapkv+adakv"]["kv_bytes_ratio"] == 1.0
    held = raw["held"]["snapkv+adakv"]
    assert held["head_range"] is not None and held["padded_bytes"] > held["after_prefill_bytes"]
    reference = raw["held"]["snapkv"]["after_prefill_bytes"]
    assert headwise["snapkv+adakv"]["padded_bytes_ratio"] == held["padded_bytes"] / reference
    seconds = raw["per_token_seconds"]
    ratio = seconds["snapkv+adakv"]["median_wall_seconds"] / seconds["snapkv"]["median_wall_seconds"]
    assert headwise["snapkv+adakv"]["decode_ratio"] == pytest.approx(ratio)
    assert "A length per head vs snapkv per layer" in bench_md(out)


def test_the_gpu_check_dry_run_says_what_it_would_run_and_its_bench_settings_compose():
    """``make gpu-check DRY=1``: the five commands a lent GPU runs (the CUDA and kernel tests, the fused pass's prefill
    bench, the bench on the 8B shapes with the leaderboard's grid, a grouped sample's operators on SmolLM2's shapes,
    the 8k grid), none run; the benches' overrides compose into the bench config as given (a key the config lacks
    would fail here)."""
    import shlex
    import subprocess

    from kvbench.config import compose

    script = PROJECT_ROOT / "scripts" / "gpu_check.sh"
    printed = subprocess.run([script], env={**os.environ, "DRY": "1"}, capture_output=True, text=True, check=True)
    lines = [shlex.split(line[2:]) for line in printed.stdout.splitlines() if line.startswith("+ ")]
    tests, fused, bench, operators, grid = lines
    assert tests[:2] == ["timeout", "150"] and tests[3:8] == ["-m", "pytest", "-q", "-m", "cuda or kernel"]
    assert "tests/test_sums_kernel.py" in tests
    assert fused[:2] == ["timeout", "150"] and bench[:2] == ["timeout", "240"] and grid[:2] == ["timeout", "90"]
    for total, bounds, code in (("200", ["150", "150", "200", "60", "90"], 0), ("10", [], 124)):  # a part: what's left
        squeezed = subprocess.run([script], env={**os.environ, "DRY": "1", "TOTAL_TIMEOUT": total}, capture_output=True)
        parts = [line.split()[2].decode() for line in squeezed.stdout.splitlines() if line.startswith(b"+ ")]
        assert parts == bounds and squeezed.returncode == code and squeezed.stderr.count(b"skipped") == 5 - len(bounds)
    first = compose(fused[6:], config_name="bench")
    assert first.engine.sums_kernel == "triton" and list(first.bench.prefill.prompt_lengths) == [8192, 32768]
    assert list(first.bench.prefill.profile) == ["h2o", "h2o+obcache_joint"]
    assert first.bench.decode.policy == "h2o+obcache_joint" and list(first.bench.decode.prompt_lengths) == [8192, 32768]
    assert list(first.bench.grid.policies) == [] and first.bench.leaderboard_grid.num_samples == 0
    assert first.bench.grid_operators.context_length == 0
    assert bench[3:6] == ["-m", "kvbench.cli", "bench"]
    cfg = compose(bench[6:], config_name="bench")
    assert cfg.model.name == "llama31_8b_random" and cfg.model.device == "cuda"
    assert list(cfg.bench.prefill.prompt_lengths) == [8192, 32768] and list(cfg.bench.grid.policies) == []
    assert {"cake", "expected_attention", "snapkv"} <= set(cfg.bench.prefill.policies)
    assert list(cfg.bench.prefill.profile) == ["cake", "expected_attention"] and not cfg.bench.decode.prompt_lengths
    board = cfg.bench.leaderboard_grid
    assert board.num_samples == 1
    stored = ["model=smollm2_135m_random", "engine.rows_attention=stored", "engine.batch_size=512"]  # all rows at once
    assert list(board.overrides) == stored
    assert operators[:2] == ["timeout", "60"]
    counted = compose(operators[6:], config_name="bench")
    assert counted.model.name == "smollm2_135m_random" and counted.bench.grid_operators.context_length == 1024
    assert list(counted.bench.prefill.prompt_lengths) == [] and counted.bench.leaderboard_grid.num_samples == 0
    last = compose(grid[6:], config_name="bench")
    assert list(last.bench.prefill.prompt_lengths) == [] and last.bench.grid.context_length == 8192
    assert list(last.bench.grid.policies) == ["full", "h2o"] and last.bench.leaderboard_grid.num_samples == 0
    assert last.bench.grid_operators.context_length == 0
    for composed in (first, cfg, counted, last):  # what kvbench bench checks before it loads the model
        check_bench(composed)


@pytest.mark.parametrize("packed", [False, True])
def test_the_leaderboard_grid_section_times_both_and_names_each_prediction_that_differs(tmp_path, monkeypatch, packed):
    """``bench.leaderboard_grid``: the full-cache job alone and the grid as one grouped sweep, each one ``kvbench
    run`` (faked here: each writes its run directories), their cost ratio, and every prediction of the grid against
    the committed run of the same settings but for the engine's added ones (``engine.rows_attention``: another
    digest; a sample the committed run lacks is not compared), the committed runs plain or packed (``kvbench pack``,
    as results/ commits them)."""
    import kvbench.bench.grid as grid_module
    from kvbench.rundir import RunDir

    def write(folder: Path, runs: dict[str, list[str]], seconds: float, engine: str = "each") -> None:
        for name, predictions in runs.items():
            run_dir = RunDir(folder / name)
            run_dir.path.mkdir(parents=True)
            settings = {"policy": name.split("-")[0], "seed": 1 if name.endswith("-v") else 0}
            run_dir.write_config({**settings, "engine": {"rows_attention": engine}})
            for number, prediction in enumerate(predictions):
                timing = {"total_seconds": seconds * (number + 1)}
                record = {"id": f"s-{number}", "subtask": "t", "score": 0.0, "prediction": prediction}
                run_dir.append({**record, "timing": timing})

    committed = tmp_path / "project" / "results" / "board"
    runs = {"snapkv-10pct-v": ["b", "B"], "snapkv-10pct-x": ["a", "b"], "tova-10pct-y": ["c", "d"]}  # v: seed 1
    write(committed / "m" / "ruler", runs, 0)
    if packed:
        from kvbench.packed import pack

        monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
        pack(committed)
        shutil.rmtree(committed / "m")

    def fake_run(arguments: list[str], log) -> tuple[float, int]:
        output = next(a for a in arguments if a.startswith("hydra.sweep.dir="))
        folder = Path(output.split("=", 1)[1])
        if folder.name == "full":
            assert arguments[:4] == ["run", "-m", "policy=full", "task.context_length=1024"]  # the grid's full job
            write(folder / "m" / "ruler", {"full-10pct-z": ["e", "f"]}, 0.5)
            return 2.0, 100
        if folder.name.startswith("grid-"):  # the grid again at another sample count, for its peak memory
            assert f"task.num_samples={folder.name[5:]}" in arguments
            return 1.0, 300 + int(folder.name[5:])
        runs = {"snapkv-10pct-w": ["a", "B"], "tova-10pct-y": ["c", "d"], "full-10pct-z": ["e", "f"]}
        write(folder / "m" / "ruler", runs, 1.5, "stored")  # snapkv: another digest, x's settings but stored
        return 9.0, 300

    monkeypatch.setattr(grid_module, "run_measured", fake_run)
    monkeypatch.setattr(grid_module, "full_cache_job", lambda arguments: ["policy=full", "task.context_length=1024"])
    monkeypatch.setattr(grid_module, "PROJECT_ROOT", tmp_path / "project")
    section = {"experiment": "board", "num_samples": 2, "overrides": [], "memory_samples": [2, 6]}
    settings = OmegaConf.create({"leaderboard_grid": section})
    fake = SimpleNamespace(bench=settings, cfg=OmegaConf.create({"engine": {"threads": 1}}))
    board = grid_module.leaderboard_grid(fake)["leaderboard_grid"]
    assert (board["jobs"], board["full_seconds"], board["grid_seconds"], board["cost_ratio"]) == (3, 2.0, 9.0, 4.5)
    # a sample's cost from the records: the full job 0.5 s and 1.0 s, the grid's three runs 1.5 s each and 3.0 s each
    assert (board["full_sample_seconds"], board["grid_sample_seconds"], board["sample_cost_ratio"]) == (0.75, 6.75, 9.0)
    assert board["predictions_compared"] == 4 and board["differing_predictions"] == ["m/ruler/snapkv-10pct-w:s-1"]
    assert board["full_predictions_equal"] and board["device"] == "cpu"  # the jobs' model, device auto, here
    assert (board["full_peak_rss_bytes"], board["grid_peak_rss_bytes"]) == (100, 300)
    assert board["grid_peak_rss_bytes_by_samples"] == {"2": 302, "6": 306}


def test_a_kvbench_process_is_measured_by_its_own_peak_memory(tmp_path):
    """:func:`~kvbench.bench.grid.run_measured`: a real ``kvbench`` process, its wall time and its own peak resident
    memory (more than the interpreter's, less than this machine's)."""
    from kvbench.bench.grid import run_measured

    seconds, peak = run_measured(["policies"], tmp_path / "log")
    assert seconds > 0 and 20 * 2**20 < peak < 64 * 2**30


def test_the_grid_jobs_run_the_benchs_model_nested_shapes_included():
    """The grid's ``kvbench run`` processes get the bench's model as overrides: a random model's overridden shapes
    (``model.random.*``, nested mappings too) reach the job's config, not the shapes of the YAML file."""
    from kvbench.bench.grid import model_overrides
    from kvbench.config import compose

    given = ["model=llama31_8b_random", "model.device=cpu", "model.random.hidden_size=64", "model.random.head_dim=16"]
    given.append("model.random.rope_parameters.factor=4.0")
    bench_model = compose(given, config_name="bench").model
    job_model = compose(model_overrides(bench_model)).model
    assert OmegaConf.to_container(job_model, resolve=True) == OmegaConf.to_container(bench_model, resolve=True)
    assert job_model.random.hidden_size == 64 and job_model.random.rope_parameters.factor == 4.0


def test_the_leaderboard_grids_full_cache_job_reads_the_grids_prompts():
    """The full-cache job the leaderboard grid is measured against gets what the sweep gives its jobs (the
    experiment's sweeper params: RULER at 1k), not the task's own default context length."""
    from kvbench.bench.grid import full_cache_job

    job = full_cache_job(["+experiment=leaderboard", "task.num_samples=2"])
    assert "policy=full" in job and "++task.context_length=1024" in job and "++task.num_samples=2" in job
    # the section's overrides reach it as they reach the grid's jobs (the GPU check's model)
    assert "model=smollm2_135m_random" in full_cache_job(["+experiment=leaderboard", "model=smollm2_135m_random"])


def test_every_bench_setting_has_a_domain_its_default_is_in():
    """conf/bench.yaml's ``bench`` node: each setting (a dotted key) has a domain in ``BENCH_SETTINGS``, and none is
    declared that the node lacks; the defaults pass every check."""
    from kvbench.bench.settings import BENCH_SETTINGS, flat
    from kvbench.config import compose

    cfg = compose([], config_name="bench")
    assert set(flat(OmegaConf.to_container(cfg.bench, resolve=True))) == set(BENCH_SETTINGS)
    check_bench(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("bench.repetitions=two", "bench.repetitions=two: must be a repetition count ≥ 1"),
        ("bench.repetitions=0", "bench.repetitions=0: must be a repetition count ≥ 1"),
        ("bench.prefill.policies=[nosuch]", "unknown policy 'nosuch'; valid choices: "),
        ("bench.grid.policies=[snapkv,nosuch]", "unknown policy 'nosuch'; valid choices: "),
        ("bench.grid.rows_policy=nosuch", "unknown policy 'nosuch'; valid choices: "),
        ("bench.grid.budgets=[64,lots]", "invalid budget 'lots'"),
        ("bench.nosuch=1", "bench.nosuch is not a bench setting; valid choices: repetitions,"),
        ("bench.prefill.prompt_lengths=[96,abc]", "bench.prefill.prompt_lengths=[96, 'abc']: must be a list of token"),
        ("bench.decode.new_tokens=1", "bench.decode.new_tokens=1: must be a new-token count ≥ 2"),
        (
            "bench.generate.prompt_lengths=[32,1]",
            "bench.generate.prompt_lengths=[32, 1]: must be a list of token counts ≥ 2",
        ),
        (
            "bench.grid_operators.context_length=1",
            "bench.grid_operators.context_length=1: must be 0 (the section skipped)",
        ),
        ("bench.prompt_source=book", "bench.prompt_source=book: must be one of essays, paragraph"),
        ("bench.grid_operators.profile_rows=-1", "bench.grid_operators.profile_rows=-1: must be a row count ≥ 0"),
        ("bench.kvpress.enabled=maybe", "bench.kvpress.enabled=maybe: must be true or false"),
        ("bench.memory.regime=foo", "bench.memory.regime=foo: must be one of oneshot, chunked, streaming"),
        ("bench.grid_operators.budgets=[zz]", "invalid budget 'zz'; use a positive token count"),
        ("bench.headwise.policies=[snapkv,snapkv+nope]", "unknown policy modifier 'nope'; valid choices: adakv,"),
        ("bench.leaderboard_grid.experiment=nope", "unknown bench.leaderboard_grid.experiment 'nope'; valid choices:"),
        ("+bench.prefill.rows=3", "bench.prefill.rows is not a bench setting; valid choices: repetitions,"),
    ],
)
def test_a_bad_bench_value_is_one_line_before_anything_loads_or_is_written(tmp_path, capsys, override, message):
    out = tmp_path / "bench"
    assert message in refused(capsys, ["bench", "model=tiny_llama", override, f"output_dir={out}"], out)
