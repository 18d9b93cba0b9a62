"""Progress: what a run and a sweep say of how far they are (a progress bar, a line a minute)."""

from __future__ import annotations

import logging
import sys
import threading
import time

from tqdm import tqdm

from kvbench import duration

log = logging.getLogger("kvbench.run")  # one logger for the run layer (the jobs' log lines name it)


#: the format of a job's log lines (Hydra's job logging's)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class Progress:
    """Per-sample progress: tqdm's bar in a terminal; without one (a pipe, a Slurm log) a log line after the
    first sample, then every ``every`` seconds and at the end, with the rate and the time left. ``sweep``: a job of
    a sweep that says its progress as a whole (:class:`SweepProgress`), which counts its samples; the job's own line
    comes at its end only."""

    def __init__(self, total: int, label: str, every: float = 30.0, sweep: SweepProgress | None = None):
        self.total, self.label, self.every, self.sweep = total, label, every, sweep
        self.done = 0
        self.started = self.last = time.monotonic()
        self.bar = tqdm(total=total, desc=label) if sys.stderr.isatty() and sweep is None else None
        if sweep is not None:
            sweep.opened(total)

    def advance(self) -> None:
        self.done += 1
        if self.sweep is not None:
            self.sweep.written()
        if self.bar is not None:
            self.bar.update()
            return
        now = time.monotonic()
        alone = self.sweep is None
        if self.done == self.total or (alone and (self.done == 1 or now - self.last >= self.every)):
            self.last = now
            per_sample = (now - self.started) / self.done
            left = per_sample * (self.total - self.done)
            log.info(
                "%s: %d/%d samples, %.2f s/sample, about %s left",
                self.label,
                self.done,
                self.total,
                per_sample,
                duration(left),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class SweepProgress:
    """The progress of a sweep whose jobs run in this process, as a whole: a line ``first`` seconds after it starts,
    then every ``every`` seconds, from a thread (rows decode several samples together: a sample can take minutes
    to finish) — the samples written of those to run, their rate and the time left. A job's samples count once it
    starts; the jobs not started yet are taken to have as many as the started ones on average."""

    def __init__(self, jobs: int, first: float = 20.0, every: float = 60.0):
        self.jobs, self.first, self.every = jobs, first, every
        self.started_jobs = self.total = self.done = 0
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self.report, name="kvbench-sweep-progress", daemon=True)

    def opened(self, samples: int) -> None:
        with self.lock:
            self.started_jobs += 1
            self.total += samples

    def written(self) -> None:
        with self.lock:
            self.done += 1

    def line(self) -> str:
        with self.lock:
            started_jobs, total, done = self.started_jobs, self.total, self.done
        seconds = time.monotonic() - self.started
        expected = round(total / started_jobs * self.jobs) if started_jobs else None
        text = f"kvbench: sweep: {done}/{expected if expected is not None else '?'} samples written"
        text += f", {started_jobs}/{self.jobs} jobs started, {duration(seconds)} in"
        if done and expected is not None:
            text += f", {done / seconds:.2f} samples/s, about {duration(seconds / done * (expected - done))} left"
        else:
            text += "; the first samples' rows are running"
        return text

    def report(self) -> None:
        wait = self.first
        while not self.finished.wait(wait):
            print(self.line(), file=sys.stderr, flush=True)
            wait = self.every

    def __enter__(self) -> SweepProgress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished.set()
