"""A run directory: ``config.yaml``, ``predictions.jsonl`` (appended per sample) and ``metrics.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.errors import KVBenchError


class RunDir:
    """Reads and writes one run's files; predictions are appended and flushed as each sample finishes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_path = self.path / "config.yaml"
        self.predictions_path = self.path / "predictions.jsonl"
        self.metrics_path = self.path / "metrics.json"

    def write_config(self, cfg: DictConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, self.config_path, resolve=True)

    def records(self) -> list[dict[str, Any]]:
        """Finished samples; a line cut short by an interrupted run is ignored (that sample is redone)."""
        if not self.predictions_path.exists():
            return []
        records = []
        for line in self.predictions_path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def append(self, record: dict[str, Any]) -> None:
        with self.predictions_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def repair(self) -> None:
        """Drop a truncated trailing line so appends start on a fresh line."""
        records = self.records()
        if self.predictions_path.exists():
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            if text != self.predictions_path.read_text(encoding="utf-8"):
                self.predictions_path.write_text(text, encoding="utf-8")

    def write_kept(self, sample_id: str, prompt_ids: list[int], kept: list[list[list[int]]]) -> None:
        """``kept/<sample id>.json``: the prompt ids and the positions kept after prefill, ``kept[layer][head]``
        (``engine.save_kept``), written before the sample's prediction line."""
        folder = self.path / "kept"
        folder.mkdir(parents=True, exist_ok=True)
        name = "".join(char if char.isalnum() or char in "-_." else "_" for char in sample_id)
        (folder / f"{name}.json").write_text(json.dumps({"id": sample_id, "prompt_ids": prompt_ids, "kept": kept}))

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        temporary = self.metrics_path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(metrics, indent=2, ensure_ascii=False), encoding="utf-8")
        temporary.replace(self.metrics_path)

    def metrics(self) -> dict[str, Any]:
        if not self.metrics_path.exists():
            raise KVBenchError(f"no metrics.json in run directory {self.path}: has the run finished?")
        return json.loads(self.metrics_path.read_text(encoding="utf-8"))


def find_run_dirs(paths: list[str | Path]) -> list[RunDir]:
    """Every run directory (holding metrics.json) at or below the given paths."""
    found = []
    for path in map(Path, paths):
        if not path.exists():
            raise KVBenchError(f"run directory {path} does not exist")
        candidates = [path] if (path / "metrics.json").exists() else sorted(p.parent for p in path.rglob("metrics.json"))
        found.extend(RunDir(candidate) for candidate in candidates)
    if not found:
        raise KVBenchError(f"no finished runs (metrics.json) under {', '.join(map(str, paths))}")
    return found
