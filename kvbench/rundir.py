"""A run directory: ``config.yaml``, ``predictions.jsonl`` (appended per sample), ``metrics.json`` and
``run.lock``, which the one process writing the directory holds.

A run directory holds one configuration, its *identity*: every setting of the resolved config except those
in :data:`~kvbench.identity.NOT_IDENTITY`, which change no prediction. A run resumes a directory only when the saved
identity equals its own (:meth:`RunDir.check_same_run`); the default directory names carry the identity's digest
(:func:`run_name`), so runs with different settings never meet in one directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_omega_conf_dumper
from omegaconf._utils import get_yaml_loader as omegaconf_loader  # its own, bound before kvbench.config sets ours

from kvbench import file_name
from kvbench.errors import KVBenchError, system_error
from kvbench.identity import identity_differences, run_digest
from kvbench.packed import PACKED, unpacked

#: what every finished sample's line holds that a task's aggregate reads (:func:`kvbench.run.records.record_of`
#: writes more), with the types it has; a task adds
#: the fields its aggregate reads (``Task.required_fields``). A line without them is not a finished sample: it is redone
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {"id": str, "subtask": (str, type(None)), "score": (int, float)}


def complete(record: Any, fields: tuple[str, ...] = ()) -> bool:
    """Whether ``record`` (a parsed line) is a finished sample's: a dict with :data:`RECORD_FIELDS` of their types,
    and ``fields``."""
    return (
        isinstance(record, dict)
        and all(isinstance(record.get(key, ...), kind) for key, kind in RECORD_FIELDS.items())
        and all(key in record for key in fields)
    )


#: ``resume=``: ``auto`` resumes a directory holding the same settings and refuses one holding others;
#: ``restart`` moves the directory's files into a dated ``superseded-*`` sub-folder and starts afresh
RESUME_MODES = ("auto", "restart")


def run_name(*, _root_: DictConfig) -> str:
    """The default run directory below ``results/`` (the ``${run_name:}`` resolver of conf/config.yaml):
    ``<model>/<task>/<policy>-<budget>-<regime>-<digest>`` (a quantised cache's policy as ``<policy>+<quant>``),
    the digest :func:`~kvbench.identity.run_digest`, so runs whose settings differ land in different directories and
    a rerun of the same settings (a single run or a job of a sweep) finds its own."""
    model, task, policy, budget, engine = (_root_[key] for key in ("model", "task", "policy", "budget", "engine"))
    quant = _root_.get("cache", {}).get("quant", "none")
    method = policy.name if quant == "none" else f"{policy.name}+{quant}"
    return f"{model.name}/{task.name}/{method}-{budget.spec}-{engine.regime}-{run_digest(_root_)}"


def register_run_name() -> None:
    """Make ``${run_name:}`` resolvable in configs (conf/config.yaml's ``output_dir`` and sweep subdirectory)."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name)


#: the signals that stop a command once the sample being written is on disk (:func:`stops_held`; kvbench.cli's handler)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stops:
    """The stop signal held back while a sample is written and counted (:func:`stops_held`)."""

    held = False
    pending: int | None = None


@contextmanager
def stops_held() -> Iterator[None]:
    """A stop signal (SIGINT, SIGTERM) whose handler asks :func:`held_back` takes effect when the block ends: the
    signal is raised again then. (Masking the signal would not do: the kernel hands a process's signal to any of its
    threads, torch's included, and Python runs the handler in the main thread at once.)"""
    _Stops.held = True
    try:
        yield
    finally:
        _Stops.held = False
        pending, _Stops.pending = _Stops.pending, None
        if pending is not None:
            signal.raise_signal(pending)


def held_back(signum: int) -> bool:
    """Whether a stop signal arrived inside :func:`stops_held` (it is raised again at the block's end)."""
    if _Stops.held:
        _Stops.pending = signum
    return _Stops.held


@cache
def config_loader() -> type:
    """OmegaConf's YAML loader (its float and path resolvers, no timestamps, a key twice refused) over libyaml's
    scanner and parser where PyYAML has them: the pure-Python ones were a third of ``kvbench leaderboard`` over
    the committed runs."""
    ours = omegaconf_loader()
    if not yaml.__with_libyaml__:
        return ours

    def construct_mapping(loader: Any, node: yaml.MappingNode, deep: bool = False) -> Any:
        keys = [key.value for key, _ in node.value if key.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG]
        if len(keys) != len(set(keys)):
            twice = next(key for key in keys if keys.count(key) > 1)
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {twice}"
            )
        return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)

    namespace = {
        "construct_mapping": construct_mapping,
        "yaml_implicit_resolvers": ours.yaml_implicit_resolvers,
        "yaml_constructors": ours.yaml_constructors,
    }
    return type("ConfigLoader", (yaml.CSafeLoader,), namespace)


@cache
def config_dumper() -> type:
    """OmegaConf's YAML dumper (a string that would read as a bool or a number quoted) over libyaml's emitter where
    PyYAML has it: the text of ``OmegaConf.to_yaml``, byte for byte, at a ninth of its time."""
    ours = get_omega_conf_dumper()
    if not yaml.__with_libyaml__:
        return ours
    namespace = {"yaml_representers": ours.yaml_representers, "yaml_multi_representers": ours.yaml_multi_representers}
    return type("ConfigDumper", (yaml.CDumper,), namespace)


def config_text(settings: Mapping[str, Any]) -> str:
    """``config.yaml``'s text of resolved ``settings`` (plain values), as ``OmegaConf.save`` writes them."""
    return yaml.dump(
        dict(settings), Dumper=config_dumper(), default_flow_style=False, allow_unicode=True, sort_keys=False
    )


class RunDir:
    """Reads and writes one run's files; predictions are appended and flushed as each sample finishes."""

    #: the sample lines this process has written, in every run directory (what an interrupted command tells)
    appended: ClassVar[int] = 0

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_path = self.path / "config.yaml"
        self.predictions_path = self.path / "predictions.jsonl"
        self.metrics_path = self.path / "metrics.json"
        self.lock_path = self.path / "run.lock"
        self.claimed = False  # whether this process has named itself in the held lock (claim)
        self._saved: tuple[tuple[int, int], dict[str, Any]] | None = None  # config.yaml read, by its file's stamp

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock while writing it: a second process refuses with one line.

        An exclusive ``flock`` on ``run.lock``, which the kernel releases when the holder ends, however it
        ends (a cancelled or killed job leaves no stale lock). Taking it changes no byte of the directory: the
        holder is named in the file (for the message) by :meth:`claim`, once the job is known to be valid, and
        the name is cleared when the lock is let go; a lock file made for a job that ran nothing is removed."""
        self.path.mkdir(parents=True, exist_ok=True)
        created = not self.lock_path.exists()
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
            try:
                yield
            finally:
                if self.claimed:
                    handle.truncate(0)  # the holder's name, written by claim(), goes with the lock
                    self.claimed = False
                elif created:  # nothing was run: the directory is left as it was found
                    self.lock_path.unlink(missing_ok=True)

    def claim(self) -> None:
        """Name this process in the held lock file, for the message of a second process."""
        self.lock_path.write_text(f"process {os.getpid()} on {socket.gethostname()}\n", encoding="utf-8")
        self.claimed = True

    def discard_if_unused(self) -> None:
        """Remove the directory if it is empty (made for a job that failed before writing anything), and the empty
        folders above it inside the working directory (``results/<model>/<task>/`` made for it)."""
        run, top = self.path.absolute(), Path.cwd().absolute()
        folder = run
        while folder.is_dir() and not any(folder.iterdir()) and (folder == run or top in folder.parents):
            folder.rmdir()
            folder = folder.parent

    def saved_config(self) -> dict[str, Any] | None:
        """``config.yaml`` as a plain dict (read once while the file is unchanged: read only), or None when there is
        none; a one-line error where it is not a YAML mapping."""
        if not self.config_path.exists():
            return None
        stat = self.config_path.stat()
        stamp = stat.st_mtime_ns, stat.st_size
        if self._saved is not None and self._saved[0] == stamp:
            return self._saved[1]
        try:  # read as OmegaConf.load reads it (config_loader), no DictConfig built: a saved config is resolved
            saved = yaml.load(self.config_path.read_text(encoding="utf-8"), Loader=config_loader())
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            reason = str(error).strip().splitlines()[0]
            raise KVBenchError(
                f"{self.config_path} is not readable YAML ({reason}); move it aside, or run with resume=restart"
            ) from None
        if not isinstance(saved, dict):
            raise KVBenchError(
                f"{self.config_path} is not a mapping of settings; move it aside, or run with resume=restart"
            )
        self._saved = stamp, saved
        return saved

    def holds_results(self) -> bool:
        """Whether any result file (config, predictions, metrics, kept sets) is in the directory."""
        return any(path.exists() for path in self.result_paths())

    def result_paths(self) -> tuple[Path, ...]:
        """The run's result files and its folder of kept sets (not its lock nor its log)."""
        return (self.config_path, self.predictions_path, self.metrics_path, self.path / "kept")

    def conflict(self, settings: Mapping[str, Any]) -> str | None:
        """Why this directory cannot be resumed by a run of ``settings`` (a resolved config dict), else None."""
        saved = self.saved_config()
        if saved is None:
            if not self.holds_results():
                return None
            return f"run directory {self.path} holds results but no config.yaml"
        changed = identity_differences(saved, settings)
        if not changed:
            return None
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        return f"run directory {self.path} holds a run of other settings: {'; '.join(changed[:3])}{more}"

    def check_same_run(self, settings: Mapping[str, Any]) -> None:
        """Refuse, in one line, to resume a directory that holds a run of other settings; say the ways out."""
        reason = self.conflict(settings)
        if reason is not None:
            raise KVBenchError(
                f"{reason}; run into another output_dir=DIR, or pass resume=restart to move its files into "
                f"{self.path}/superseded-<time>/ and start again"
            )

    def move_aside(self) -> Path | None:
        """``resume=restart``: move the result files into ``superseded-<UTC time>/`` (nothing is deleted);
        the folder, or None when there was nothing to move."""
        present = [path for path in self.result_paths() if path.exists()]
        if not present:
            return None
        folder = self.path / time.strftime("superseded-%Y%m%dT%H%M%SZ", time.gmtime())
        folder.mkdir()
        for path in present:
            shutil.move(path, folder / path.name)
        return folder

    def start(self, settings: Mapping[str, Any], fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The job is valid: name this process in the held lock file, repair ``predictions.jsonl`` for appending
        (``fields``: what the task's records hold besides :data:`RECORD_FIELDS`) and write ``config.yaml``: the job's
        settings, or where the directory already holds records, the saved settings that made them with only
        ``task.num_samples`` (how far the run goes) made the job's (a setting outside the identity, such as
        ``engine.batch_size``, is not rewritten under records it did not make). ``settings``: the resolved job's
        (:attr:`~kvbench.job.Job.settings`). Returns the finished records."""
        self.claim()
        records = self.repair(fields)
        settings, saved = dict(settings), self.saved_config()
        if saved is not None and records:
            settings = {**saved, "task": {**saved.get("task", {}), "num_samples": settings["task"].get("num_samples")}}
        if saved != settings:
            self.write_config(settings)
        return records

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

    def write_config(self, settings: Mapping[str, Any]) -> None:
        """``config.yaml``: a job's resolved settings."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config_text(settings), encoding="utf-8")
        self._saved = None  # read again: a rewrite within the clock's tick may keep the file's stamp

    def records(self, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Finished samples, one per id (the first line written for it), in the order written; a line cut short
        by an interrupted run is ignored (that sample is redone), so is a second line for an id, and a line that is
        not a finished sample's (:func:`complete`, with the task's ``fields``)."""
        if not self.predictions_path.exists():
            return []
        records: dict[Any, dict[str, Any]] = {}
        for line in self.predictions_path.read_text(encoding="utf-8").split("\n"):  # not splitlines: U+2028 is text
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if complete(record, fields):
                records.setdefault(record["id"], record)
        return list(records.values())

    def append(self, record: dict[str, Any]) -> None:
        """One finished sample's line, on disk when this returns (counted in :attr:`appended`; a stop signal waits
        until it is both written and counted); a disk that refuses it is a one-line error naming the file and the
        free space."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            with stops_held(), self.predictions_path.open("a", encoding="utf-8") as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
                RunDir.appended += 1
        except OSError as error:  # a full disk: a partial line, which the next run's repair drops
            raise system_error(error, self.predictions_path) from None

    def repair(self, fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Rewrite predictions.jsonl as :meth:`records` reads it (no truncated, repeated or incomplete line), so
        appends start on a fresh line; returns those records."""
        records = self.records(fields)
        if self.predictions_path.exists():
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            if text != self.predictions_path.read_text(encoding="utf-8"):
                self.predictions_path.write_text(text, encoding="utf-8")
        return records

    def write_kept(self, sample_id: str, prompt_ids: list[int], kept: list[list[list[int]]]) -> None:
        """``kept/<sample id>.json``: the prompt ids and the positions kept after prefill, ``kept[layer][head]``
        (``engine.save_kept``), written before the sample's prediction line."""
        folder = self.path / "kept"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"id": sample_id, "prompt_ids": prompt_ids, "kept": kept}
        (folder / file_name(sample_id, ".json")).write_text(json.dumps(record))

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        temporary = self.metrics_path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(metrics, indent=2, ensure_ascii=False), encoding="utf-8")
        temporary.replace(self.metrics_path)

    def metrics(self) -> dict[str, Any]:
        if not self.metrics_path.exists():
            raise KVBenchError(f"no metrics.json in run directory {self.path}: has the run finished?")
        return json.loads(self.metrics_path.read_text(encoding="utf-8"))


def finished_metrics(run_dir: RunDir, settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metrics of a finished run of this same (resolved) config in ``run_dir`` (metrics.json written,
    the same identity and ``task.num_samples`` in config.yaml, a prediction for every sample counted), else None: a
    resubmitted sweep skips its finished jobs without loading the model. ``settings``: the resolved job's."""
    if not run_dir.metrics_path.exists() or run_dir.conflict(dict(settings)) is not None:
        return None
    if (run_dir.saved_config() or {}).get("task", {}).get("num_samples") != settings["task"].get("num_samples"):
        return None
    metrics = run_dir.metrics()
    done = {record["id"] for record in run_dir.records()}
    return metrics if len(done) >= metrics.get("num_samples", len(done) + 1) else None


RUN_FILES = ("metrics.json", "predictions.jsonl", "config.yaml", "run.lock")
"""Files only a run directory holds; a folder with any of them is one (they do not nest)."""


def runs_below(path: Path) -> dict[Path, Path]:
    """The run directories at or below ``path`` by their path below it, sorted; hidden folders (``.hydra``,
    ``.submitit``) are not searched, nor is a run directory's inside (its ``wandb/`` folder). A folder's packed runs
    (``runs.tar.xz``: :mod:`kvbench.packed`) are read from their extraction in the cache, where the folder has no run
    directory of the same path."""
    if any((path / name).exists() for name in RUN_FILES):
        return {Path(): path}
    found = {}
    for child in sorted(path.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            found.update({child.name / below: run for below, run in runs_below(child).items()})
    if (path / PACKED).is_file():
        for below, run in runs_below(unpacked(path / PACKED)).items():
            found.setdefault(below, run)
    return {below: found[below] for below in sorted(found, key=lambda below: below.parts)}


def run_dirs_below(path: Path) -> list[Path]:
    """The run directories at or below ``path``, sorted by their path below it (:func:`runs_below`)."""
    return list(runs_below(path).values())
