"""Finished runs read back from their run directories: the read model of every report (``kvbench table``,
``leaderboard``, ``compare-paper``, ``plot``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.identity import TABLE_IDENTITY
from kvbench.rundir import RunDir, run_dirs_below
from kvbench.tasks.registry import task_class

NO_BUDGET = "–"
#: what a sample cost (:meth:`Run.sample_costs`): the tokens it generated, the most its cache held and what it held on
#: average while it generated evicting (MiB)
COST_NAMES = ("generated", "kv_peak_mib", "kv_mean_mib")
"""The budget column of the full cache, which keeps every token whatever budget its run was given."""


@dataclass
class Run:
    """One finished run directory: its metrics and the resolved config it ran with."""

    run_dir: RunDir

    @cached_property
    def metrics(self) -> dict[str, Any]:
        return self.run_dir.metrics()

    @cached_property
    def config(self) -> dict[str, Any]:
        return self.run_dir.saved_config() or {}

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        return self.run_dir.records()

    @property
    def task(self) -> str:
        return self.metrics["task"]

    @property
    def context(self) -> int | None:
        """The run's context length, as its task tells it from its settings
        (:meth:`~kvbench.tasks.base.Task.context_size`); None for a task this version does not know."""
        task = task_class(self.task)
        return None if task is None else task.context_size(self.config.get("task", {}))

    @property
    def metric(self) -> str:
        """What the run's sample scores are: ``perplexity`` where its records carry token NLLs (the perplexity tasks,
        whose ``score`` is the window's perplexity), else ``score`` (0–1, shown ×100)."""
        return "perplexity" if any("nll" in record for record in self.records) else "score"

    def sample_scores(self) -> dict[str, dict[str, float]]:
        """The run's per-sample scores by subtask (the task's name where records have none): ``{subtask: {sample id:
        score}}``, from each record's numeric ``score``: ×100, a perplexity as it is (:attr:`metric`)."""
        scale = 1.0 if self.metric == "perplexity" else 100.0
        scores: dict[str, dict[str, float]] = {}
        for record in self.records:
            score = record.get("score")
            if isinstance(score, int | float) and not isinstance(score, bool):
                scores.setdefault(record.get("subtask") or self.task, {})[str(record["id"])] = scale * float(score)
        return scores

    def sample_costs(self, pooled: bool = False) -> dict[str, dict[str, float]]:
        """By subtask (``pooled``: all under ``""``), the mean over the run's records of what a sample cost:
        ``generated``, the tokens it generated (records that count them), ``kv_peak_mib``, the most its cache held
        (MiB; the generation's own peak where the cache evicts while decoding), and there ``kv_mean_mib``, the mean of
        what it held after each generated token."""
        costs: dict[str, dict[str, list[float]]] = {}
        for record in self.records:
            by_cost = costs.setdefault("" if pooled else record.get("subtask") or self.task, {})
            if "generated_tokens" in record:
                by_cost.setdefault("generated", []).append(float(record["generated_tokens"]))
            if isinstance(kv := record.get("kv"), dict) and "peak_bytes" in kv:
                peak = kv.get("generation", {}).get("peak_bytes", kv["peak_bytes"])
                by_cost.setdefault("kv_peak_mib", []).append(peak / 2**20)
                if "mean_bytes" in kv.get("generation", {}):
                    by_cost.setdefault("kv_mean_mib", []).append(kv["generation"]["mean_bytes"] / 2**20)
        return {
            subtask: {name: sum(values) / len(values) for name, values in by_cost.items()}
            for subtask, by_cost in costs.items()
        }

    def sample_clusters(self) -> dict[str, str] | None:
        """Each sample id's cluster, by which intervals resample whole clusters: its ``context_id`` where the run's
        questions share contexts (RULER's ``questions_per_context``, LongBench's repeated documents), else its
        ``problem`` where it is one of a problem's draws (``generation.num_samples``). None where no record has
        either."""
        clusters = {
            str(record["id"]): str(record.get("context_id", record.get("problem")))
            for record in self.records
            if "context_id" in record or "problem" in record
        }
        return clusters or None

    @property
    def query_mode(self) -> str:
        """``task.query_mode``: ``aware`` (also a run from before the setting) or ``agnostic``."""
        return str(self.config.get("task", {}).get("query_mode") or "aware")

    @property
    def data(self) -> str:
        """What a perplexity run read: the text file's stem, else the task name."""
        path = self.config.get("task", {}).get("path")
        return Path(path).stem if path else self.task

    @property
    def settings(self) -> dict[str, Any]:
        """The policy's hyper-parameters (``policy.*`` of the config, without ``name``); the layer budget as its
        name, its own settings as ``layer_budget.<key>``."""
        settings = {key: value for key, value in self.config.get("policy", {}).items() if key != "name"}
        layer_budget = settings.pop("layer_budget", None)
        if isinstance(layer_budget, dict):
            settings["layer_budget"] = layer_budget.get("name")
            settings.update({f"layer_budget.{key}": value for key, value in layer_budget.items() if key != "name"})
        return settings

    @property
    def label(self) -> str:
        """``policy@budget``; the full cache as ``full`` (it keeps every token whatever its budget)."""
        policy = self.table_identity()["policy"]
        return policy if policy == "full" else f"{policy}@{self.metrics['budget']}"

    def table_identity(self) -> dict[str, Any]:
        """Model, policy (its label: :attr:`~kvbench.policies.base.Policy.label`), budget (none for the full cache)
        and regime."""
        identity = {key: self.metrics.get(key) for key in TABLE_IDENTITY}
        identity["policy"] = self.metrics.get("label", identity["policy"])
        return {**identity, "budget": NO_BUDGET} if identity["policy"] == "full" else identity


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Every finished run at or below ``paths`` (see :func:`find_run_dirs`)."""
    return [Run(run_dir) for run_dir in find_run_dirs(paths)]


LABELS = ("model", "policy", "budget", "task")
"""What metrics.json says a run is, each read from config.yaml as ``<group>.name`` (the budget's ``spec``)."""


def unfinished_reason(run_dir: RunDir) -> str | None:
    """Why ``run_dir`` cannot go into a table (no or unreadable metrics.json, metrics that its config.yaml or
    its predictions contradict), else None."""
    if not run_dir.metrics_path.exists():
        state = "being written now" if run_dir.locked() else "unfinished or failed"
        return f"no metrics.json ({state})"
    try:
        metrics = run_dir.metrics()
        missing = [key for key in (*LABELS, "scores") if key not in metrics]
        saved = run_dir.saved_config()
        done = len(run_dir.records())
    except KVBenchError as error:
        return str(error)
    except (OSError, ValueError, TypeError) as error:
        return f"cannot read its files ({type(error).__name__}: {error})"
    if missing:
        return f"metrics.json has no {', '.join(missing)}"
    if saved is None:
        return "no config.yaml"
    for label in LABELS:
        configured = saved.get(label, {}).get("spec" if label == "budget" else "name")
        if str(configured) != str(metrics[label]):
            return f"metrics.json is of {label} {metrics[label]}, config.yaml of {label} {configured}"
    if done != metrics.get("num_samples"):
        return f"metrics.json counts {metrics.get('num_samples')} samples, predictions.jsonl holds {done}"
    return None


def scan_run_dirs(paths: list[str | Path]) -> tuple[list[RunDir], list[tuple[RunDir, str]]]:
    """The run directories at or below ``paths``: those with readable metrics, and the others with the reason
    each is left out (see :func:`unfinished_reason`)."""
    finished, left_out = [], []
    for path in map(Path, paths):
        if not path.exists():
            raise KVBenchError(f"run directory {path} does not exist")
        for run_dir in map(RunDir, run_dirs_below(path)):
            reason = unfinished_reason(run_dir)
            if reason is None:
                finished.append(run_dir)
            else:
                left_out.append((run_dir, reason))
    if not finished:
        first = f" ({left_out[0][0].path}: {left_out[0][1]}{', ...' if len(left_out) > 1 else ''})" if left_out else ""
        unfinished = f"; {len(left_out)} run directories left out{first}" if left_out else ""
        raise KVBenchError(f"no finished runs (metrics.json) under {', '.join(map(str, paths))}{unfinished}")
    return finished, left_out


def find_run_dirs(paths: list[str | Path]) -> list[RunDir]:
    """Every finished run directory (readable metrics.json) at or below the given paths."""
    return scan_run_dirs(paths)[0]
