"""``kvbench bench``: what eviction costs and saves, measured in one process: every section of
``kvbench.bench.sections`` and the kvpress comparison, written to ``bench.json`` and ``bench.md`` after each."""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.bench import kvpress
from kvbench.bench.contexts import shared_contexts
from kvbench.bench.grid import grid, grid_operators, leaderboard_grid
from kvbench.bench.markdown import markdown
from kvbench.bench.report import machine, targets
from kvbench.bench.sections import Bench
from kvbench.bench.settings import check_bench
from kvbench.engine.threads import set_threads
from kvbench.models import ModelSpec, load_model

log = logging.getLogger(__name__)


def run_sections(bench: Bench, out: Path) -> dict[str, Any]:
    """All sections; ``bench.json`` and ``bench.md`` in ``out`` are rewritten after each one (a long run
    that is interrupted keeps what it measured). Returns the ``bench.json`` document."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"prefill_overhead": {}, "prefill_overhead_cpu": {}, "decode_latency_ratio": None}
    results.update(harness_vs_generate=None, kv_bytes={}, memory={}, raw={})

    def save() -> None:
        results["targets"] = targets(results, bench.loaded.device.type)
        results["machine"] = machine(bench.loaded)
        results["prompt_source"] = bench.prompt_source
        results["config"] = OmegaConf.to_container(bench.cfg, resolve=True)
        results["elapsed_seconds"] = time.perf_counter() - started
        (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "bench.md").write_text(markdown(results))

    bench.warm_up()
    sections = bench.bench
    for title, enabled, measure in (
        ("prefill overhead", sections.prefill.prompt_lengths, bench.prefill),
        ("decode latency", sections.decode.prompt_lengths, bench.decode),
        ("memory", sections.memory.prompt_lengths and sections.memory.policies, bench.memory_section),
        ("head-wise", len(sections.headwise.policies) > 1, bench.headwise),
        ("kvbench vs model.generate", sections.generate.prompt_lengths, bench.generate),
        ("kvpress", sections.kvpress.enabled, lambda: {"kvpress": kvpress.compare(bench)}),
        ("grid", sections.grid.policies and sections.grid.budgets, lambda: grid(bench)),
        ("contexts", sections.contexts.policies and sections.contexts.budgets, lambda: shared_contexts(bench)),
        ("grid operators", sections.grid_operators.context_length, lambda: grid_operators(bench)),
        ("leaderboard grid", sections.leaderboard_grid.num_samples, lambda: leaderboard_grid(bench)),
    ):
        if enabled:
            log.info(title)
            measured = measure()
            results["raw"].update(measured.pop("raw", {}))
            results.update(measured)
            save()
    save()
    return results


def output_directory(cfg: DictConfig) -> Path:
    """``output_dir``, or ``results/bench/<timestamp>``."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("results") / "bench" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def run_bench(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    """Run the benchmark configured by ``cfg`` into ``bench.json`` and ``bench.md``; the results and their folder."""
    check_bench(cfg)  # before anything loads or is written
    out = output_directory(cfg)
    set_threads(cfg.engine.threads)
    return run_sections(Bench(cfg, load_model(ModelSpec.of(cfg.model))), out), out
