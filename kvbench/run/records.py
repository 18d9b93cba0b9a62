"""What a run writes: each sample's record and the run's metrics (the schema of predictions.jsonl and metrics.json),
and its one result line."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from statistics import mean
from typing import Any

from kvbench.engine.runner import GenerationOutput, PerplexityOutput
from kvbench.job import Job
from kvbench.models import LoadedModel
from kvbench.results.intervals import bootstrap_mean
from kvbench.tasks.base import Sample, Task

log = logging.getLogger("kvbench.run")  # one logger for the run layer (the jobs' log lines name it)


def record_of(
    task: Task,
    sample: Sample,
    output: GenerationOutput | PerplexityOutput,
    loaded: LoadedModel,
    seconds: float | None = None,
) -> dict[str, Any]:
    """The predictions.jsonl record of ``sample`` from the engine's output (``seconds``: the sample's time; by default
    its prefill and decode, shares of the forwards it shared)."""
    seconds = output.prefill_seconds + output.decode_seconds if seconds is None else seconds
    result: list[float] | str  # the perplexity task's NLLs, or the decoded text
    if isinstance(output, PerplexityOutput):
        result = output.nlls
    else:
        result = str(loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True))
    record = {"id": sample.id, "subtask": sample.subtask, **task.evaluate(sample, result), "answers": sample.answers}
    if sample.context_id is not None:
        record["context_id"] = sample.context_id
    if "draw" in sample.metadata:  # one of generation.num_samples traces of a problem
        record["problem"], record["draw"] = sample.metadata["problem"], sample.metadata["draw"]
    record["prompt_tokens"] = len(sample.input_ids)
    if isinstance(output, GenerationOutput):  # the trace's length; whether the model ended it before the cap
        record["generated_tokens"] = len(output.token_ids)
        record["stopped"] = len(output.token_ids) < sample.max_new_tokens
    record["kv"] = asdict(output.kv)
    if isinstance(output, GenerationOutput) and output.kv_curve:  # an evicting cache over the generation
        record["kv"]["generation"] = kv_over_generation(output.kv_curve)
    record["policy_stats"] = output.policy_stats
    record["timing"] = {
        "prefill_seconds": output.prefill_seconds,
        "decode_seconds": output.decode_seconds,
        "total_seconds": seconds,
    }
    if isinstance(output, GenerationOutput) and output.prefill_shared_by > 1:  # a share of one shared forward
        record["timing"]["prefill_shared_by"] = output.prefill_shared_by
    if isinstance(output, GenerationOutput) and output.context_shared_by > 1:  # a share of one context's compression
        record["timing"]["context_shared_by"] = output.context_shared_by
    if isinstance(output, GenerationOutput) and output.scoring_seconds > 0:  # of prefill: reconstructing the context
        record["timing"]["scoring_seconds"] = output.scoring_seconds
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


#: the points of a record's KV curve at most (:func:`kv_over_generation`)
CURVE_POINTS = 32


def kv_over_generation(curve: list[int]) -> dict[str, Any]:
    """The bytes an evicting cache held after each decode step, as a record keeps them: their peak and mean, and the
    curve at most :data:`CURVE_POINTS` steps apart evenly (the last step always one of them)."""
    stride = -(-len(curve) // CURVE_POINTS)
    return {"peak_bytes": max(curve), "mean_bytes": mean(curve), "curve": curve[::-1][::stride][::-1], "stride": stride}


def pass_at_k(draws: int, correct: int, k: int) -> float:
    """The unbiased estimator of the chance that one of ``k`` draws is correct, from ``draws`` of which ``correct``
    were (Chen et al. 2021, eq. 1): ``1 − C(n − c, k) / C(n, k)``."""
    return 1.0 - math.comb(draws - correct, k) / math.comb(draws, k)


def sampled_scores(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``pass@k`` for k = 1, 2, 4, ... up to the draws of a problem, and ``avg@n``, over the problems of the records
    of several draws (``problem``; a draw is correct where it scores 1), 0-100, and their 95 % bootstrap
    ``intervals`` over problems (a problem's draws are not independent: its estimate is one value); {} without such
    records."""
    by_problem: dict[str, list[float]] = {}
    for record in records:
        if "problem" in record:
            by_problem.setdefault(str(record["problem"]), []).append(float(record["score"]))
    if not by_problem:
        return {}
    draws = min(len(scores) for scores in by_problem.values())
    ks = sorted({2**power for power in range(draws.bit_length())} | {draws})  # 1, 2, 4, ... ≤ draws, and draws
    per_problem = {
        f"pass@{k}": [100 * pass_at_k(len(s), sum(x >= 1.0 for x in s), k) for s in by_problem.values()] for k in ks
    }
    per_problem[f"avg@{draws}"] = [100 * mean(s) for s in by_problem.values()]
    intervals = {name: bootstrap_mean(values) for name, values in per_problem.items()}
    return {
        **{name: mean(values) for name, values in per_problem.items()},
        "intervals": {name: [interval.low, interval.high] for name, interval in intervals.items()},
    }


def generation_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``generation``: the records' mean generated tokens and the share that stopped before the cap (generating
    records only: eviction can lengthen a trace, so less memory may cost more time), and with several draws of each
    problem their :func:`sampled_scores`."""
    made = [record for record in records if "generated_tokens" in record]
    if not made:
        return {}
    return {
        "generation": {
            "mean_generated_tokens": mean(record["generated_tokens"] for record in made),
            "stopped_share": mean(float(record["stopped"]) for record in made),
            **sampled_scores(made),
        }
    }


def summarize(
    job: Job, task: Task, records: list[dict[str, Any]], load: tuple[float, int] = (0.0, 1)
) -> dict[str, Any]:
    """metrics.json: task scores (0–100), KV-cache sizes (max over samples) and summed timings: the records' own
    decode, their prefill (a shared prefill's share), and the job's share of ``load`` (the seconds this process
    took to load the model and build the samples, and how many jobs of a group they served)."""
    cfg, scores = job.cfg, task.aggregate(records)
    average = scores["ppl"] if "ppl" in scores else (mean(scores.values()) if scores else None)
    kv = [record["kv"] for record in records]
    return {
        "model": cfg.model.name,
        "policy": cfg.policy.name,
        "label": job.label,
        "budget": str(cfg.budget.spec),
        "task": cfg.task.name,
        "regime": job.engine.regime,
        "scores": scores,
        "average": average,
        "num_samples": len(records),
        "kv_cache": {
            "after_prefill_tokens_per_layer": [
                max(column) for column in zip(*(k["after_prefill_tokens_per_layer"] for k in kv))
            ],
            "peak_tokens_per_layer": [max(column) for column in zip(*(k["peak_tokens_per_layer"] for k in kv))],
            "peak_bytes": max((k["peak_bytes"] for k in kv), default=0),
            "full_bytes": max((k["full_bytes"] for k in kv), default=0),
        },
        "policy_stats": mean_policy_stats(records),
        **generation_summary(records),
        "timing": {
            **{
                name: sum(record["timing"][name] for record in records)
                for name in ("prefill_seconds", "decode_seconds", "total_seconds")
            },
            "prefill_shared_by": mean([record["timing"].get("prefill_shared_by", 1) for record in records] or [1]),
            **(
                {"scoring_seconds": sum(record["timing"].get("scoring_seconds", 0.0) for record in records)}
                if any("scoring_seconds" in record["timing"] for record in records)
                else {}
            ),
            "load_seconds": load[0] / load[1],
            "load_shared_by": load[1],
        },
    }


def rounded(value: Any) -> Any:
    """Scores as printed: 2 decimals (metrics.json keeps full precision)."""
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    return value


def result_line(metrics: dict[str, Any]) -> str:
    """The JSON line a finished job prints: what ran and its scores, rounded."""
    return json.dumps(
        rounded({key: metrics[key] for key in ("model", "policy", "budget", "task", "scores", "average")})
    )
