"""``kvbench run``: one model × policy × budget × task, written to a resumable run directory."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kvbench.engine import Engine
from kvbench.engine.models import LoadedModel, load_model
from kvbench.errors import KVBenchError
from kvbench.policies import build_policy
from kvbench.policies.budgets import Budget
from kvbench.results.rundir import RunDir
from kvbench.results.wandb_logger import log_run
from kvbench.tasks.base import ModelInfo, Sample, Task

log = logging.getLogger(__name__)


def build_task(cfg: DictConfig, tokenizer) -> Task:
    """Instantiate the task class named by ``task._target_`` for this model's tokenizer, window and id."""
    try:
        task_class = get_class(cfg.task._target_)
    except Exception as error:
        raise KVBenchError(f"task {cfg.task.name!r}: cannot import {cfg.task._target_}: {error}") from None
    info = ModelInfo(cfg.model.name, tokenizer, int(cfg.model.context_window), cfg.model.hf_id)
    return task_class(cfg.task, info)


def build_engine(cfg: DictConfig, loaded: LoadedModel) -> Engine:
    policy_params = OmegaConf.to_container(cfg.policy, resolve=True)
    return Engine(
        loaded.model,
        build_policy(cfg.policy.name, policy_params),
        Budget.parse(cfg.budget.spec),
        regime=cfg.engine.regime,
        block_size=cfg.engine.block_size,
        decode_evict=cfg.engine.decode_evict,
        attn_backend=loaded.attn_backend,
        score_block=cfg.engine.score_block,
    )


def stop_ids(sample: Sample, loaded: LoadedModel) -> list[int]:
    """The model's stop tokens plus the last token of each of the sample's stop strings (LongBench samsum)."""
    extra = [loaded.tokenizer.encode(text, add_special_tokens=False)[-1] for text in sample.metadata.get("stop_strings", [])]
    return [*loaded.stop_token_ids, *extra]


def run_sample(engine: Engine, task: Task, sample: Sample, loaded: LoadedModel) -> dict[str, Any]:
    """Run one sample through the engine and score it: the record written to predictions.jsonl."""
    started = time.perf_counter()
    if sample.mode == "perplexity":
        output = engine.perplexity(sample.input_ids, sample.context_tokens)
        result = output.nlls
    else:
        output = engine.generate(sample.input_ids, sample.max_new_tokens, stop_ids(sample, loaded), sample.min_new_tokens)
        result = loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    record = {"id": sample.id, "subtask": sample.subtask, **task.evaluate(sample, result), "answers": sample.answers}
    record["prompt_tokens"] = len(sample.input_ids)
    record["kv"] = asdict(output.kv)
    record["policy_stats"] = output.policy_stats
    record["timing"] = {
        "prefill_seconds": output.prefill_seconds,
        "decode_seconds": output.decode_seconds,
        "total_seconds": time.perf_counter() - started,
    }
    return record


def mean_policy_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over samples of each policy statistic (e.g. CaliDrop's recomputation rate), element-wise for lists."""
    stats = [record.get("policy_stats") or {} for record in records]
    merged: dict[str, Any] = {}
    for name in sorted({key for entry in stats for key in entry}):
        values = [entry[name] for entry in stats if name in entry]
        if all(isinstance(value, (int, float)) for value in values):
            merged[name] = mean(values)
        elif all(isinstance(value, list) for value in values) and len({len(value) for value in values}) == 1:
            merged[name] = [mean(column) for column in zip(*values)]
    return merged


def summarize(cfg: DictConfig, task: Task, records: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json: task scores (0–100), KV-cache sizes (max over samples) and summed timings."""
    scores = task.aggregate(records)
    average = scores["ppl"] if "ppl" in scores else (mean(scores.values()) if scores else None)
    kv = [record["kv"] for record in records]
    return {
        "model": cfg.model.name,
        "policy": cfg.policy.name,
        "budget": str(cfg.budget.spec),
        "task": cfg.task.name,
        "regime": cfg.engine.regime,
        "scores": scores,
        "average": average,
        "num_samples": len(records),
        "kv_cache": {
            "after_prefill_tokens_per_layer": [max(column) for column in zip(*(k["after_prefill_tokens_per_layer"] for k in kv))],
            "peak_tokens_per_layer": [max(column) for column in zip(*(k["peak_tokens_per_layer"] for k in kv))],
            "peak_bytes": max((k["peak_bytes"] for k in kv), default=0),
            "full_bytes": max((k["full_bytes"] for k in kv), default=0),
        },
        "policy_stats": mean_policy_stats(records),
        "timing": {
            name: sum(record["timing"][name] for record in records)
            for name in ("prefill_seconds", "decode_seconds", "total_seconds")
        },
    }


def finished_metrics(run_dir: RunDir, cfg: DictConfig) -> dict[str, Any] | None:
    """The metrics of a finished run of this same config in ``run_dir`` (metrics.json written, config.yaml
    unchanged but for the logger, a prediction for every sample counted), else None: a resubmitted sweep
    skips its finished jobs without loading the model."""
    if not (run_dir.metrics_path.exists() and run_dir.config_path.exists()):
        return None
    saved = OmegaConf.to_container(OmegaConf.load(run_dir.config_path))
    current = OmegaConf.to_container(cfg, resolve=True)
    if {k: v for k, v in saved.items() if k != "logger"} != {k: v for k, v in current.items() if k != "logger"}:
        return None
    metrics = run_dir.metrics()
    done = {record["id"] for record in run_dir.records()}
    return metrics if len(done) >= metrics.get("num_samples", len(done) + 1) else None


def run(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run (or resume) the configured job into ``output_dir``; returns the metrics. A finished run of the
    same config is not run again (:func:`finished_metrics`)."""
    run_dir = RunDir(output_dir)
    finished_before = finished_metrics(run_dir, cfg)
    if finished_before is not None:
        log.info("skipping %s: finished with this config", run_dir.path)
        return finished_before
    run_dir.write_config(cfg)
    run_dir.repair()
    loaded = load_model(cfg.model)
    engine = build_engine(cfg, loaded)
    task = build_task(cfg, loaded.tokenizer)
    records = run_dir.records()
    finished = {record["id"] for record in records}
    samples = [sample for sample in task.samples() if sample.id not in finished]
    if finished:
        log.info("resuming %s: %d samples done, %d to go", run_dir.path, len(finished), len(samples))
    for sample in tqdm(samples, desc=f"{cfg.task.name} {cfg.policy.name}@{cfg.budget.spec}", disable=None):
        record = run_sample(engine, task, sample, loaded)
        run_dir.append(record)
        records.append(record)
    metrics = summarize(cfg, task, records)
    run_dir.write_metrics(metrics)
    log_run(cfg, run_dir, metrics, records)
    return metrics
