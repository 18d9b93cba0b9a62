"""``logger=wandb``: a finished run logged to Weights & Biases (off by default, ``logger=none``).

One W&B run per kvbench run, in the run directory's ``wandb/`` folder: the resolved config, per-task
scores and the average (``scores/<task>``, ``average``), KV-cache figures (``kv_cache/*``: mean tokens
per layer after prefill, peak per layer, peak and full-cache bytes and their ratio), timings
(``timing/*``), the predictions as a table and, for needle runs, the depth × length heatmap; the run's
metrics.json is saved with it as ``files/kvbench-metrics.json``.

Mode (``logger.mode``): ``online``, ``offline`` or ``disabled``; null picks ``WANDB_MODE`` if set, else
``online`` when an API key is configured (``WANDB_API_KEY`` or a ``~/.netrc`` entry for the W&B host), else
``offline`` — an offline run can be uploaded later with ``wandb sync <run_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

import json
import netrc
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

from kvbench.rundir import RunDir

WandbMode = Literal["online", "offline", "disabled", "shared"]

PREDICTION_COLUMNS = ["id", "subtask", "prediction", "answers", "score", "prompt_tokens", "total_seconds"]
METRICS_FILE = "kvbench-metrics.json"


def api_key_configured() -> bool:
    """Whether W&B could log in without asking: ``WANDB_API_KEY`` or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode(configured: str | None) -> WandbMode:
    """``logger.mode`` if set, else ``WANDB_MODE``, else online with an API key and offline without."""
    if configured:
        return cast(WandbMode, configured)
    if os.environ.get("WANDB_MODE"):
        return cast(WandbMode, os.environ["WANDB_MODE"])
    return "online" if api_key_configured() else "offline"


def wandb_summary(metrics: dict[str, Any]) -> dict[str, float]:
    """The run's numbers as flat W&B keys."""
    values: dict[str, float] = {f"scores/{name}": value for name, value in metrics["scores"].items()}
    if metrics.get("average") is not None:
        values["average"] = metrics["average"]
    kv = metrics.get("kv_cache", {})
    after = kv.get("after_prefill_tokens_per_layer") or []
    if after:
        values["kv_cache/after_prefill_tokens_mean"] = sum(after) / len(after)
        values["kv_cache/peak_tokens_max"] = max(kv.get("peak_tokens_per_layer") or [0])
    for key in ("peak_bytes", "full_bytes"):
        if key in kv:
            values[f"kv_cache/{key}"] = kv[key]
    if kv.get("full_bytes"):
        values["kv_cache/peak_over_full"] = kv["peak_bytes"] / kv["full_bytes"]
    values.update({f"timing/{name}": seconds for name, seconds in metrics.get("timing", {}).items()})
    values["num_samples"] = metrics.get("num_samples", 0)
    return values


def prediction_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """One table row per record (answers joined, time from the record's timing)."""
    return [
        [
            record.get("id"),
            record.get("subtask"),
            record.get("prediction"),
            " | ".join(map(str, record.get("answers") or [])),
            record.get("score"),
            record.get("prompt_tokens"),
            (record.get("timing") or {}).get("total_seconds"),
        ]
        for record in records
    ]


def log_run(
    settings: Mapping[str, Any], run_dir: RunDir, metrics: dict[str, Any], records: list[dict[str, Any]]
) -> None:
    """Log a finished run when its resolved ``settings`` say ``logger.name=wandb``; nothing otherwise."""
    logger = settings.get("logger") or {}
    if logger.get("name") != "wandb":
        return
    import wandb

    from kvbench.results.plots import niah_figure, plt
    from kvbench.results.table import record_value

    name = f"{metrics['model']}/{metrics['task']}/{metrics['policy']}@{metrics['budget']}"
    tags = [*(logger.get("tags") or []), metrics["model"], metrics["task"], metrics["policy"]]
    with wandb.init(
        project=logger.get("project"),
        entity=logger.get("entity"),
        mode=wandb_mode(logger.get("mode")),
        name=name,
        tags=tags,
        dir=str(run_dir.path),
        config=dict(settings),
        reinit="finish_previous",
        settings=wandb.Settings(console="off", silent=True),
    ) as run:
        values = wandb_summary(metrics)
        run.log(values)
        run.summary.update(values)
        run.log(
            {"predictions": wandb.Table(columns=list[str | int](PREDICTION_COLUMNS), data=prediction_rows(records))}
        )
        needles = [
            record
            for record in records
            if record_value(record, "depth") is not None and record_value(record, "context_length") is not None
        ]
        if needles:
            figure = niah_figure(needles, name)
            run.log({"niah_heatmap": wandb.Image(figure)})
            plt.close(figure)
        copy = Path(run.dir) / METRICS_FILE  # also a plain file in the W&B run, readable before any sync
        copy.write_text(json.dumps(metrics, indent=2, ensure_ascii=False), encoding="utf-8")
        run.save(str(copy), base_path=run.dir, policy="now")
        offline = run.settings.mode == "offline"
        folder = Path(run.dir).parent
    where = f"offline in {folder} (upload it with: wandb sync {folder})" if offline else f"at {run.url}"
    print(f"kvbench: W&B run {name} logged {where}", file=sys.stderr)
