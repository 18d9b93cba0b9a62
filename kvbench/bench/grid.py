"""The ``grid`` section of ``kvbench bench``: what a sweep's grouping saves, end to end.

The ``policies`` × ``budgets`` jobs of one task are run twice: one ``kvbench run`` process each, one after
another, decoding one sample at a time (how the scripts kvbench replaces run a grid), then as one ``kvbench run -m``
sweep whose group loads the model once, prefills each prompt once for its variants (``hydra.sweeper.share_prefill``)
and decodes the (sample, variant) rows together (``engine.batch_size``). Both write their run
directories under the same names, so their predictions are compared record by record. Memory: the peak RSS of
one prompt's prefill shared by every variant (:func:`~kvbench.engine.shared.generate_shared`) beside one job's
prefill, each in a fresh process, against the bound of one job plus every other variant's evicted cache and one
layer's full keys/values.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from kvbench import PROJECT_ROOT
from kvbench.allocator import PEAK_RSS_FILE
from kvbench.bench.measure import Operators, fresh_process, profiled, ranked
from kvbench.budgets import Budget
from kvbench.config import compose, config_dict, policy_node, registered_policies, selected_policy_settings
from kvbench.engine import Engine
from kvbench.engine.rows import decode_rows
from kvbench.engine.shared import Prompt, generate_shared, prefill_shared
from kvbench.engine.store import RowStore
from kvbench.errors import KVBenchError
from kvbench.identity import ADDED_SETTINGS, flatten, run_identity
from kvbench.launch.sweeps import sweep_loader, sweep_overrides
from kvbench.models import ModelSpec, load_model, resolve_device
from kvbench.policies import build_policy
from kvbench.rundir import RunDir, runs_below

if TYPE_CHECKING:
    from kvbench.bench.sections import Bench


def model_overrides(model: DictConfig) -> list[str]:
    """The bench's model as ``kvbench run`` overrides: its group option and every scalar setting it runs with, nested
    ones (a random model's ``model.random.*`` shapes) included."""
    settings = flatten(config_dict(model, resolve=True), "model.")
    scalars = [
        f"{key}={'null' if value is None else value}"
        for key, value in settings.items()
        if key != "model.name" and not isinstance(value, dict | list)
    ]
    return [f"model={model.name}", *scalars]


def job_overrides(cfg: DictConfig, section: DictConfig | None = None) -> list[str]:
    """The overrides every job of a section (the grid's by default) shares: the bench's model, the section's task and
    length, and its samples where it names them."""
    section = cfg.bench.grid if section is None else section
    task = [str(override) for override in section.task]
    sizes = [f"task.context_length={section.context_length}"]
    if "num_samples" in section:
        sizes.append(f"task.num_samples={section.num_samples}")
    return [*model_overrides(cfg.model), *task, *sizes]


def run_kvbench(arguments: list[str], log: Path) -> float:
    """Run ``kvbench ARGUMENTS`` in a new process (its output to ``log``); its wall seconds."""
    return run_measured(arguments, log)[0]


def run_measured(arguments: list[str], log: Path) -> tuple[float, int]:
    """Run ``kvbench ARGUMENTS`` in a new process (its output to ``log``); its wall seconds and peak resident bytes:
    its own ``VmHWM`` as it exits (:data:`PEAK_RSS_FILE`), else the kernel's ``ru_maxrss`` reaped with ``wait4``
    (which is at least this process's size when it forked: Linux keeps the forked copy's peak across ``exec``)."""
    start = time.perf_counter()
    peak = log.with_name(f"peak-{time.monotonic_ns()}.txt")
    with log.open("a", encoding="utf-8") as output:
        command = [sys.executable, "-m", "kvbench.cli", *arguments]
        environment = {**os.environ, PEAK_RSS_FILE: str(peak)}
        process = subprocess.Popen(command, stdout=output, stderr=output, env=environment)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise KVBenchError(f"bench grid: kvbench {' '.join(arguments)} failed (exit {process.returncode}); see {log}")
    own = int(peak.read_text()) if peak.exists() else usage.ru_maxrss * 1024  # kilobytes on Linux
    return time.perf_counter() - start, own


def predictions(root: Path) -> dict[str, dict[str, str]]:
    """Each run directory under ``root`` (by its path below it; a packed folder's too): its predictions by sample
    id."""
    return {
        str(below): {record["id"]: record["prediction"] for record in RunDir(run).records()}
        for below, run in runs_below(root).items()
        if (run / "predictions.jsonl").exists()
    }


def engine_free(run: Path) -> str | None:
    """A run's identity with the engine settings added since its first runs at their first values
    (:data:`~kvbench.rundir.ADDED_SETTINGS`: how rows are attended, the sums' kernel), as JSON; None where it saved no
    settings."""
    settings = RunDir(run).saved_config()
    if settings is None:
        return None
    engine = settings.setdefault("engine", {})
    engine.update({key.split(".", 1)[1]: ADDED_SETTINGS[key] for key in ENGINE_ADDED})
    return json.dumps(run_identity(settings), sort_keys=True, default=str)


#: the engine settings added since the first runs: a run of another value than their first is the same run but for
#: how it is computed
ENGINE_ADDED = {key for key in ADDED_SETTINGS if key.startswith("engine.")}


def twins(runs: dict[Path, Path], committed: dict[Path, Path]) -> dict[str, str]:
    """Each of ``runs`` (by path below their root) to the committed run of the same settings but for the engine's
    added ones (:func:`engine_free`; a run of fewer samples shares its directory), or of its own name where neither
    saved settings."""
    by_settings = {settings: str(below) for below, run in committed.items() if (settings := engine_free(run))}
    found = {}
    for below, run in runs.items():
        settings = engine_free(run)
        twin = by_settings.get(settings) if settings else (str(below) if below in committed else None)
        if twin is not None:
            found[str(below)] = twin
    return found


def sample_seconds(root: Path) -> dict[str, float]:
    """What each sample cost the runs under ``root`` together: the sum over runs of its record's
    ``timing.total_seconds`` (each run's share of the shared prefill and of the decode steps it was in), by sample id
    — a sweep's cost a sample, without process start, composition and model load."""
    cost: dict[str, float] = {}
    for run in runs_below(root).values():
        for record in RunDir(run).records():
            cost[record["id"]] = cost.get(record["id"], 0.0) + float(record["timing"]["total_seconds"])
    return cost


def grid(bench: Bench) -> dict[str, Any]:
    """The grid section's fields of ``bench.json``: ``grid`` (the speed-up, the predictions' agreement, the memory
    rows) and its raw per-job seconds."""
    section = bench.bench.grid
    policies, budgets = [str(spec) for spec in section.policies], [str(budget) for budget in section.budgets]
    shared = job_overrides(bench.cfg)
    with tempfile.TemporaryDirectory(prefix="kvbench-grid-") as folder:
        root, log = Path(folder), Path(folder) / "kvbench.log"
        separate: dict[str, float] = {}
        for spec in policies:
            for budget in budgets:
                output = f"output_dir={root}/separate/${{run_name:}}"
                job = ["run", *shared, f"policy={spec}", f"budget={budget}", "engine.batch_size=1", output]
                separate[f"{spec}@{budget}"] = run_kvbench(job, log)
        sweep = ["run", "-m", *shared, f"policy={','.join(policies)}", f"budget={','.join(budgets)}"]
        grouped = run_kvbench([*sweep, "hydra.sweeper.share_prefill=true", f"hydra.sweep.dir={root}/grouped"], log)
        alone, together = predictions(root / "separate"), predictions(root / "grouped")
    if len(alone) != len(separate) or set(alone) != set(together):
        raise KVBenchError(f"bench grid: {len(alone)} separate and {len(together)} grouped run directories")
    differing = sorted(name for name in alone if alone[name] != together[name])
    separate_seconds = sum(separate.values())
    result = {
        "variants": len(separate),
        "samples": int(section.num_samples),
        "separate_seconds": separate_seconds,
        "grouped_seconds": grouped,
        "speed_ratio": separate_seconds / grouped,
        "predictions_equal": not differing,
        "differing_runs": differing,
        "memory": grid_memory(bench),
        "rows": decode_rows_speed(bench),
    }
    return {"grid": result, "raw": {"grid": {"separate_seconds": separate}}}


def full_cache_job(arguments: list[str]) -> list[str]:
    """The overrides of the first full-cache job (``policy=full``) of the sweep ``kvbench run -m ARGUMENTS``: every
    setting the sweep gives it (an experiment's ``hydra.sweeper.params``, such as its task's context length, apply to
    a sweep's jobs only), to run it alone, as a sweep of that one job, on the grid's own samples."""
    with sweep_loader(arguments) as (config_loader, master):
        jobs = sweep_overrides(config_loader, master)
    full = next((job for job in jobs if "policy=full" in job), None)
    if full is None:
        raise KVBenchError(f"bench leaderboard_grid: kvbench run -m {' '.join(arguments)} has no policy=full job")
    return full


def leaderboard_grid(bench: Bench) -> dict[str, Any]:
    """The leaderboard's own grid (``bench.leaderboard_grid``: every job of ``+experiment=<experiment>`` on its first
    ``num_samples`` samples) as one grouped ``kvbench run -m`` against its full-cache job alone (:func:`full_cache_job`:
    the same prompts), each one process: end to end, and a sample's cost (:func:`sample_seconds`, the mean over the
    samples); every prediction against the committed run of the same settings (``results/<experiment>``: a run of
    fewer samples shares its directory; the engine's added settings, such as ``engine.rows_attention``, aside:
    :func:`twins`), and the full-cache job's against the grid's run of it; the device the jobs ran on. ``overrides``:
    both runs', after the experiment's (another model: its runs have other settings, and no prediction is compared)."""
    section = bench.bench.leaderboard_grid
    common = [f"+experiment={section.experiment}", f"task.num_samples={section.num_samples}"]
    common += [f"engine.threads={bench.cfg.engine.threads}", *section.overrides]
    alone = full_cache_job(common)
    device = resolve_device(compose(alone).model.device).type  # where the jobs run (``auto``: a GPU if there is one)
    with tempfile.TemporaryDirectory(prefix="kvbench-leaderboard-grid-") as folder:
        root, log = Path(folder), Path(folder) / "kvbench.log"
        full, full_peak = run_measured(["run", "-m", *alone, f"hydra.sweep.dir={root}/full"], log)  # a sweep of one
        grouped, grid_peak = run_measured(["run", "-m", *common, f"hydra.sweep.dir={root}/grid"], log)
        full_alone, together = predictions(root / "full"), predictions(root / "grid")
        matched = twins(runs_below(root / "grid"), runs_below(PROJECT_ROOT / "results" / section.experiment))
        full_sample, grid_sample = sample_seconds(root / "full"), sample_seconds(root / "grid")
        peaks = {}  # the grid's peak at other sample counts: bounded by the batch, not by the samples
        for count in section.memory_samples:
            more = [*common, f"task.num_samples={count}", f"hydra.sweep.dir={root}/grid-{count}"]
            peaks[str(count)] = run_measured(["run", "-m", *more], log)[1]
    saved = predictions(PROJECT_ROOT / "results" / section.experiment)
    committed = {name: saved[twin] for name, twin in matched.items() if twin in saved}
    differing = sorted(
        f"{name}:{sample}"
        for name, by_sample in together.items()
        for sample, prediction in by_sample.items()
        if name in committed and committed[name].get(sample, prediction) != prediction
    )
    compared = sum(len(by_sample) for name, by_sample in together.items() if name in committed)
    return {
        "leaderboard_grid": {
            "experiment": str(section.experiment),
            "device": device,
            "jobs": len(together),
            "samples": int(section.num_samples),
            "full_job": alone,
            "full_seconds": full,
            "grid_seconds": grouped,
            "cost_ratio": grouped / full,
            "full_sample_seconds": statistics.mean(full_sample.values()),
            "grid_sample_seconds": statistics.mean(grid_sample.values()),
            "sample_cost_ratio": sum(grid_sample.values()) / sum(full_sample.values()),
            "predictions_compared": compared,
            "differing_predictions": differing,
            "full_predictions_equal": bool(full_alone)
            and all(together.get(name) == by_sample for name, by_sample in full_alone.items()),
            "full_peak_rss_bytes": full_peak,
            "grid_peak_rss_bytes": grid_peak,
            "grid_peak_rss_bytes_by_samples": peaks,
        }
    }


def decode_rows_speed(bench: Bench) -> dict[str, Any]:
    """Decode tokens/s of ``bench.grid.rows`` rows decoding together (:func:`decode_rows`: ``rows_policy`` at the
    first budget, on prompts of the section's length starting at different essay offsets), each row attended alone
    padded into one call per layer and held together (``engine.rows_attention``: each, padded, stored), over the same
    rows decoded one at a time, each
    ``bench.grid.new_tokens`` tokens (no stop token); medians over the repetitions, and the tokens equal; the peak RSS
    of the batch (its rows prefilled one by one, then decoded together) beside the rows' cache bytes, and what the
    stored rows' shelves held at their largest beside the bytes the rows then reserved (kept and to come)."""
    section = bench.bench.grid
    count, new_tokens, length = int(section.rows), int(section.new_tokens), int(section.context_length)
    engine = bench.engine(str(section.rows_policy), budget=str(section.budgets[0]))
    step = max(1, (len(bench.tokens) - length) // max(count - 1, 1))
    prompts = [bench.tokens[index * step : index * step + length] for index in range(count)]
    kinds = {
        "one_row": (1, "each"),
        "rows": (count, "each"),
        "padded_rows": (count, "padded"),
        "stored_rows": (count, "stored"),
    }
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    tokens: dict[str, list[list[int]]] = {}
    store = RowStore()  # the stored rows' shelves: what they held at their largest
    for _ in range(bench.repetitions):
        for kind, (batch, attention) in kinds.items():
            rows = [engine.prefilled_row(prompt, new_tokens) for prompt in prompts]
            engine.rows_attention = attention
            decode = functools.partial(decode_rows, rows, batch, store if attention == "stored" else None)
            wall, _, outputs = bench.clock.measure(decode)
            engine.rows_attention = "each"
            seconds[kind].append(wall)
            tokens[kind] = [output.token_ids for output in outputs]
    median = {kind: statistics.median(walls) for kind, walls in seconds.items()}
    generated = sum(len(ids) for ids in tokens["rows"])
    with bench.memory.track() as memory:  # the batch's peak: its rows prefilled one by one, then decoded together
        outputs = decode_rows([engine.prefilled_row(prompt, new_tokens) for prompt in prompts], count)
    return {
        "rows": count,
        "new_tokens": new_tokens,
        "policy": f"{engine.policy.spec}@{engine.budget.spec}",
        "one_row_tokens_per_second": generated / median["one_row"],
        "rows_tokens_per_second": generated / median["rows"],
        "speed_ratio": median["one_row"] / median["rows"],
        "tokens_equal": tokens["rows"] == tokens["one_row"],
        **{
            field: value
            for kind in ("padded", "stored")
            for field, value in (
                (f"{kind}_rows_tokens_per_second", generated / median[f"{kind}_rows"]),
                (f"{kind}_speed_ratio", median["one_row"] / median[f"{kind}_rows"]),
                (f"{kind}_tokens_equal", tokens[f"{kind}_rows"] == tokens["one_row"]),
            )
        },
        "stored_peak_bytes": store.peak_bytes,
        "stored_reserved_bytes": store.reserved_at_peak,
        "memory": {**memory, "rows_cache_peak_bytes": sum(output.kv.peak_bytes for output in outputs)},
    }


def grid_memory(bench: Bench) -> dict[str, Any]:
    """Peak RSS added by the prefill of one prompt of the section's length shared by every variant, beside the
    heaviest job's prefill alone (the most tokens kept), each in a fresh process, and the bound the shared one must
    keep."""
    config = config_dict(bench.cfg, resolve=True)
    rows = {}
    for kind in ("one_job", "grouped"):
        with fresh_process() as pool:
            rows[kind] = pool.submit(grid_memory_row, config, kind).result()
    one, grouped = rows["one_job"], rows["grouped"]
    bound = one["peak_rss_delta_bytes"] + grouped["other_caches_bytes"] + grouped["layer_full_bytes"]
    return {**rows, "bound_bytes": bound, "within_bound": grouped["peak_rss_delta_bytes"] <= bound}


def grid_memory_row(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """One memory row, in a fresh process (:func:`~kvbench.bench.measure.fresh_process`): the peak RSS of the prefill
    of ``one_job`` (the variant keeping the most tokens) or of the ``grouped`` variants' shared prefill
    (:func:`generate_shared`, no token generated) on one essay prompt of the section's length, after a two-token
    prompt pages the weights in; the grouped row adds what its bound is made of."""
    from kvbench.bench.sections import Bench

    cfg = OmegaConf.create(config)
    section = cfg.bench.grid
    bench = Bench(cfg, load_model(ModelSpec.of(cfg.model)))
    prompt = bench.prompt(int(section.context_length))
    engines = [bench.engine(str(spec), budget=str(budget)) for spec in section.policies for budget in section.budgets]
    caches = [engine.new_cache(len(prompt)) for engine in engines]
    kept = [
        sum(cache.layer_budgets) if cache.policy.evicts else cache.prompt_len * len(cache.layers) for cache in caches
    ]
    heaviest = max(range(len(engines)), key=kept.__getitem__)
    chosen = engines if kind == "grouped" else [engines[heaviest]]
    generate_shared(chosen, bench.prompt(2), 1)
    with bench.memory.track() as figures:
        outputs = generate_shared(chosen, prompt, 0)
    row: dict[str, Any] = {**figures, "variants": len(chosen), "cache_peak_bytes": [o.kv.peak_bytes for o in outputs]}
    if kind == "grouped":
        row["other_caches_bytes"] = sum(row["cache_peak_bytes"]) - outputs[heaviest].kv.peak_bytes
        row["layer_full_bytes"] = outputs[heaviest].kv.full_bytes // len(caches[heaviest].layers)
    return row


def variant_engine(model, hf_id: str | None, spec: str, budget: str, settings, **engine: Any) -> Engine:
    """An :class:`Engine` of ``model`` (Hugging Face id ``hf_id``) for the variant ``spec`` at ``budget``, its policy
    built with an experiment's ``settings`` (:func:`~kvbench.config.selected_policy_settings`) and its per-model
    settings filled in; ``engine``: the engine's settings."""
    policy = build_policy(spec, policy_node(spec, settings))
    policy.for_model(hf_id, Budget.parse(budget))
    return Engine(model, policy, budget, **engine)


def grid_operators(bench: Bench) -> dict[str, Any]:
    """The operators (:class:`~kvbench.bench.measure.Operators`: on a GPU the kernel launches and the values read back)
    one sample of a grouped sweep dispatches on the bench's model: every variant of ``${policies:variants}`` (with
    ``bench.grid_operators.experiment``'s policy settings) at each budget, oneshot, one prompt of ``context_length``
    tokens prefilled by one shared forward, then its rows decoding together, each attended alone and all stored
    (``engine.rows_attention``: each, stored): the prefill's, and a decode step's (a decode of ``new_tokens`` + 4
    tokens less one of ``new_tokens``, over 4); beside one full-cache row's step. With ``profile_rows``, where a step
    of the stored rows spends its time (``step_profile``: on a GPU its kernels' device time, whose total beside the
    step's seconds says how much of the step waits on launches)."""
    section = bench.bench.grid_operators
    length, new_tokens = int(section.context_length), int(section.new_tokens)
    settings = selected_policy_settings((("experiment", str(section.experiment)),))
    specs = registered_policies("variants", regime="oneshot").split(",")
    prompt = bench.prompt(length)

    def engine(spec: str, budget: str, attention: str) -> Engine:
        return variant_engine(
            bench.loaded.model,
            bench.cfg.model.get("hf_id"),
            spec,
            budget,
            settings,
            attn_backend=bench.loaded.attn_backend,
            rows_attention=attention,
            sums_kernel=bench.cfg.engine.sums_kernel,
        )

    def counted(engines: list[Engine]) -> dict[str, float]:
        figures = []
        for tokens in (new_tokens, new_tokens + 4):
            with Operators() as prefill:
                rows = prefill_shared(engines, Prompt(prompt, tokens), batch_size=len(engines))
            started = bench.clock.start()
            with Operators() as decode:
                decode_rows(rows, len(rows))
            seconds = bench.clock.stop(started)[0]
            figures.append((prefill.launched, prefill.host_copies, decode.launched, decode.host_reads, seconds))
        # the second prefill's figures: the first makes what a process makes once (kept slots' reserved index)
        (*_, before, reads_before, seconds_before), (prefill_ops, copies, after, reads_after, seconds_after) = figures
        return {
            "prefill_operators": prefill_ops,
            "prefill_host_copies": copies,  # on a GPU each a synchronisation (0 on a CPU: bench.measure.Operators)
            # the whole decode of new_tokens: the rows joining the store, their steps, and leaving it
            "decode_operators": before,
            "step_operators": (after - before) / 4,
            "step_host_reads": (reads_after - reads_before) / 4,
            "step_seconds": (seconds_after - seconds_before) / 4,
        }

    def step_profile(engines: list[Engine]) -> dict[str, Any]:
        """Where a step's time goes (:func:`~kvbench.bench.measure.profiled`, by name): a decode of ``new_tokens``
        + 4 tokens less one of ``new_tokens``, over 4, each after its own prefill, which is not watched."""
        watched = []
        for tokens in (new_tokens, new_tokens + 4):
            rows = prefill_shared(engines, Prompt(prompt, tokens), batch_size=len(engines))
            watched.append(profiled(functools.partial(decode_rows, rows, len(rows)), bench.loaded.device))
        before, after = watched
        step = {
            name: ((calls - before.get(name, (0, 0.0))[0]) / 4, max(seconds - before.get(name, (0, 0.0))[1], 0.0) / 4)
            for name, (calls, seconds) in after.items()
        }
        return ranked(step, bench.loaded.device, int(section.profile_rows))

    by_attention: dict[str, dict[str, Any]] = {}
    for attention in ("each", "stored"):
        engines = [engine(spec, str(budget), attention) for spec in specs for budget in section.budgets]
        by_attention[attention] = counted(engines)
        if attention == "stored" and int(section.profile_rows) > 0:  # untimed: the profiler slows what it watches
            by_attention[attention]["step_profile"] = step_profile(engines)
    one = counted([engine("full", str(section.budgets[0]), "each")])
    return {
        "grid_operators": {
            "rows": len(specs) * len(section.budgets),
            "context_length": length,
            "device": bench.loaded.device.type,
            "by_attention": by_attention,
            "full_row": one,
        }
    }
