"""The operators (on a GPU, kernel launches) and values read back (synchronisations) that a sweep's samples dispatch:
a ``kvbench run`` in this process, counted (``kvbench.bench.measure.Operators``) over what makes and decodes its
samples' rows — the grouped runs' shared prefills, rows joining, stepping and leaving the store, and a job run alone's
prefill and decode — not the model's load nor the records written. ``--gpu-layout``: the shelves laid out as on a GPU
(``kvbench.engine.shelf.MODIFIER_SHELVES=mixed``). Run::

    python scripts/sample_operators.py [--gpu-layout] run -m +experiment=leaderboard task.num_samples=1 \\
        engine.rows_attention=stored engine.batch_size=512 hydra.sweep.dir=DIR

and against it the full-cache job alone (``policy=full budget=10pct``); it prints one JSON line on stderr. Before
``run``: ``--by-frame`` adds each operator (and each value read back) charged to the kvbench function that dispatched
it, the 30 largest (``kvbench.bench.measure.ByFrame``; several times slower); ``--accelerator`` has SLAKE's VABS take
its window in one block as on an accelerator (64 query rows a block on a CPU), so the counts are those a GPU would
launch but for H2O's running sums, which ``engine.sums_kernel=triton`` fuses there."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kvbench.engine.shelf as shelf
import kvbench.policies.methods.slake as slake
import kvbench.run.group as group
import kvbench.run.schedule as schedule
from kvbench.bench.measure import ByFrame, Operators
from kvbench.cli import main

#: what may come before ``run`` (the module's docstring)
OPTIONS = ("--gpu-layout", "--by-frame", "--accelerator")


class Counting:
    """Counts what the calls it wraps dispatch, once where they nest (a group's rows made inside its decode)."""

    def __init__(self, by_frame: bool = False) -> None:
        self.counter, self.inside = ByFrame() if by_frame else Operators(), False

    @contextmanager
    def counted(self) -> Iterator[None]:
        if self.inside:
            yield
            return
        self.inside = True
        try:
            with self.counter:
                yield
        finally:
            self.inside = False

    def call(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, counted."""

        def counted(*args, **kwargs) -> Any:
            with self.counted():
                return call(*args, **kwargs)

        return counted

    def generator(self, make: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        """``make``, whose generator's steps are counted (not its caller's work between them)."""

        def counted(*args, **kwargs) -> Iterator[Any]:
            items = make(*args, **kwargs)
            while True:
                with self.counted():
                    item = next(items, self)
                if item is self:
                    return
                yield item

        return counted


def run(argv: list[str]) -> dict[str, Any]:
    """``kvbench ARGV`` in this process, its samples' operators counted (the options before it: the module's)."""
    options = argv[: argv.index("run")] if "run" in argv else []
    argv = argv[len(options) :]
    for option in options:
        if option not in OPTIONS:
            print(f"sample_operators: unknown option {option!r}; valid: {', '.join(OPTIONS)}", file=sys.stderr)
            raise SystemExit(2)
    if "--gpu-layout" in options:
        shelf.MODIFIER_SHELVES = "mixed"
    if "--accelerator" in options:
        slake.VABS_BLOCK = 1 << 30  # every window in one block, whatever the variants asking (slake.vabs_block)
    counting = Counting(by_frame="--by-frame" in options)
    group.finished_rows = counting.generator(group.finished_rows)  # a group's prefills and decode
    schedule.sample_row = counting.call(schedule.sample_row)  # a job alone: its prefill,
    schedule.decode_rows = counting.call(schedule.decode_rows)  # and its decode
    sys.argv = ["kvbench", *argv]
    try:
        main()
    except SystemExit as exit:
        if exit.code not in (0, None):
            raise
    figures: dict[str, Any] = dict(counting.counter.figures())
    if isinstance(counting.counter, ByFrame):
        figures["by_frame"] = dict(counting.counter.frames.most_common(30))
        figures["read_by_frame"] = dict((+counting.counter.reads).most_common(30))
    return figures


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])), file=sys.stderr)
