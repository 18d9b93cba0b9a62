"""A run directory: ``config.yaml``, ``predictions.jsonl`` (appended per sample), ``metrics.json`` and
``run.lock``, which the one process writing the directory holds."""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
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
        self.lock_path = self.path / "run.lock"

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock while writing it: a second process refuses with one line.

        An exclusive ``flock`` on ``run.lock``, which the kernel releases when the holder ends, however it
        ends (a cancelled or killed job leaves no stale lock). The file names the holder for the message."""
        self.path.mkdir(parents=True, exist_ok=True)
        with self.lock_path.open("a+", encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise KVBenchError(
                    f"run directory {self.path} is being written by {holder}; wait for it to end "
                    f"or stop it (its lock {self.lock_path} goes with it)"
                ) from None
            handle.truncate(0)
            handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
            handle.flush()
            yield

    def locked(self) -> bool:
        """Whether a process holds the directory's lock now (is writing it)."""
        if not self.lock_path.exists():
            return False
        with self.lock_path.open(encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
        return False

    def write_config(self, cfg: DictConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, self.config_path, resolve=True)

    def records(self) -> list[dict[str, Any]]:
        """Finished samples, one per id (the first line written for it), in the order written; a line cut short
        by an interrupted run is ignored (that sample is redone), so is a second line for an id."""
        if not self.predictions_path.exists():
            return []
        records: dict[Any, dict[str, Any]] = {}
        for line in self.predictions_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "id" in record:
                records.setdefault(record["id"], record)
        return list(records.values())

    def append(self, record: dict[str, Any]) -> None:
        with self.predictions_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def repair(self) -> None:
        """Rewrite predictions.jsonl as :meth:`records` reads it (no truncated or repeated line), so appends
        start on a fresh line."""
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


RUN_FILES = ("metrics.json", "predictions.jsonl", "config.yaml", "run.lock")
"""Files only a run directory holds; a folder with any of them is one (they do not nest)."""


def run_dirs_below(path: Path) -> list[Path]:
    """The run directories at or below ``path``, sorted; hidden folders (``.hydra``, ``.submitit``) are not
    searched, nor is a run directory's inside (its ``wandb/`` folder)."""
    if any((path / name).exists() for name in RUN_FILES):
        return [path]
    found = []
    for child in sorted(path.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            found.extend(run_dirs_below(child))
    return found


def unfinished_reason(run_dir: RunDir) -> str | None:
    """Why ``run_dir`` cannot go into a table (no or unreadable metrics.json), else None."""
    if not run_dir.metrics_path.exists():
        state = "being written now" if run_dir.locked() else "unfinished or failed"
        return f"no metrics.json ({state})"
    try:
        metrics = run_dir.metrics()
        missing = [key for key in ("model", "policy", "budget", "task", "scores") if key not in metrics]
    except (OSError, ValueError, TypeError) as error:
        return f"cannot read metrics.json ({type(error).__name__}: {error})"
    return f"metrics.json has no {', '.join(missing)}" if missing else None


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
        unfinished = f"; {len(left_out)} run directories without readable metrics" if left_out else ""
        raise KVBenchError(f"no finished runs (metrics.json) under {', '.join(map(str, paths))}{unfinished}")
    return finished, left_out


def find_run_dirs(paths: list[str | Path]) -> list[RunDir]:
    """Every finished run directory (readable metrics.json) at or below the given paths."""
    return scan_run_dirs(paths)[0]
