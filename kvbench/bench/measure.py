"""Measuring: wall and CPU clocks (CUDA events on CUDA), peak process memory, the operators a call dispatches,
and the interleaving and medians every comparison of ``kvbench bench`` is made of.

The machines are shared, so every comparison is a ratio of medians over repetitions taken in one run, with
the compared variants interleaved (in a rotating order) within every repetition. CPU time
(``time.process_time``) is recorded beside wall time: another job on the cores inflates wall time, not
the CPU time this process spends.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.allocator import STATUS, release_freed_memory, status_bytes
from kvbench.errors import KVBenchError


class Clock:
    """Wall and process CPU time of a callable. On CUDA the wall time comes from CUDA events recorded on
    the current stream (``elapsed_time`` after synchronising), so it is the device's time for the work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def start(self) -> tuple[Any, float]:
        """A started reading: ``(wall clock or CUDA event, CPU clock)``."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, time.process_time()
        return time.perf_counter(), time.process_time()

    def stop(self, started: tuple[Any, float]) -> tuple[float, float]:
        """``(wall_seconds, cpu_seconds)`` since ``started``."""
        wall_start, cpu_start = started
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return wall_start.elapsed_time(end) / 1000.0, time.process_time() - cpu_start
        return time.perf_counter() - wall_start, time.process_time() - cpu_start

    def measure(self, function: Callable[[], Any]) -> tuple[float, float, Any]:
        """``(wall_seconds, cpu_seconds, result)`` of ``function()``."""
        started = self.start()
        result = function()
        return *self.stop(started), result

    @contextmanager
    def forwards(self, model: torch.nn.Module) -> Iterator[list[tuple[float, float]]]:
        """Yield a list that receives ``(wall_seconds, cpu_seconds)`` of every forward of ``model`` (through
        PyTorch module hooks: the engine's own loop is untouched)."""
        times: list[tuple[float, float]] = []
        started: list[tuple[Any, float]] = []

        def before(*_):
            started.append(self.start())

        def after(*_):
            times.append(self.stop(started.pop()))

        handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
        try:
            yield times
        finally:
            for handle in handles:
                handle.remove()


class Operators(TorchDispatchMode):
    """Counts the ATen operators a block dispatches (``with Operators() as counted: ...``), the same on every device:
    ``launched``, those that compute (on a GPU each at least one kernel launch: views and metadata left out), and
    ``host_reads``, what the host reads back: tensor values (``.item()``, ``int(t)``, an accelerator's ``.tolist()``)
    and the shapes that depend on them (:data:`SHAPE_READS`: a boolean mask's selection, ``nonzero``) — on a GPU each
    a synchronisation; on a CPU ``.tolist()`` dispatches nothing. Triton kernels are not ATen operators: a fused pass
    counts as none."""

    #: operators that only describe a tensor differently (no kernel)
    VIEWS = frozenset(
        "view _unsafe_view _reshape_alias expand slice select t transpose unsqueeze squeeze permute alias as_strided "
        "detach detach_ unbind split split_with_sizes diagonal unflatten narrow lift_fresh".split()
    )
    #: operators that copy only where they must (a dtype or device changed, slots not contiguous), else return a view
    #: or the tensor itself: counted where their output is held in new memory (under inference mode they reach the
    #: mode as themselves, not as the copy or the view they make)
    #: (``resolve_conj``/``resolve_neg``: a copy only where a conjugate or negative bit is set; ``tolist`` dispatches
    #: both on a host tensor)
    MAYBE_VIEWS = frozenset("to reshape flatten contiguous reshape_as view_as type_as resolve_conj resolve_neg".split())

    def __init__(self) -> None:
        super().__init__()
        self.launched = 0
        self.host_reads = 0
        #: copies from host memory to a device (``.to(device)`` of a host tensor): a blocking one waits for the
        #: device's queue, so each is a synchronisation as a read is
        self.host_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        output = func(*args, **(kwargs or {}))
        self.launched += name not in self.VIEWS and (name not in self.MAYBE_VIEWS or copied(args[0], output))
        # a read is ``item`` under inference mode, ``_local_scalar_dense`` outside it
        self.host_reads += name in ("item", "_local_scalar_dense") or reads_a_shape(func, args, kwargs)
        self.host_reads += name == "_to_copy" and copies_to_host(args, kwargs)
        self.host_copies += name in ("_to_copy", "copy_") and copies_from_host(name, args, kwargs)
        if name == "to" and isinstance(output, torch.Tensor) and output.device != args[0].device:  # inference mode's
            self.host_reads += output.device.type == "cpu"
            self.host_copies += args[0].device.type == "cpu"
        return output

    def figures(self) -> dict[str, int]:
        return {"operators": self.launched, "host_reads": self.host_reads, "host_copies": self.host_copies}


#: the kvbench package's folder, as the frames of a stack name its files
PACKAGE = str(Path(__file__).parents[1]) + os.sep


class ByFrame(Operators):
    """:class:`Operators`, each operator launched (and each value read back) also counted by the innermost kvbench
    function that dispatched it (``file:function`` under the package; ``(model)``: none, the model's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before, read_before = self.launched, self.host_reads
        output = super().__torch_dispatch__(func, types, args, kwargs)
        if self.launched > before or self.host_reads > read_before:
            where = "(model)"  # else the innermost kvbench function outside this file
            frame: FrameType | None = sys._getframe(1)
            while frame is not None:
                code = frame.f_code
                if code.co_filename.startswith(PACKAGE) and code.co_filename != __file__:
                    where = f"{code.co_filename.removeprefix(PACKAGE)}:{code.co_name}"
                    break
                frame = frame.f_back
            self.frames[where] += self.launched - before
            self.reads[where] += self.host_reads - read_before
        return output


#: operators whose output's shape the host reads from the device (the sizes a GPU computes: it synchronises)
SHAPE_READS = frozenset({"nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim"})


def copied(source: torch.Tensor, output: Any) -> bool:
    """Whether ``output`` is held in memory other than ``source``'s (a copy was made, not a view)."""
    if not isinstance(output, torch.Tensor) or not isinstance(source, torch.Tensor):
        return True
    if output.device != source.device or output.device.type == "meta":
        return True
    return output.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def reads_a_shape(func, args, kwargs=None) -> bool:
    """Whether the operator's output shape is read back: :data:`SHAPE_READS`, indexing by a boolean mask (it takes the
    mask's ``nonzero``), ``repeat_interleave`` by a tensor of counts without its ``output_size``."""
    name, overload = func.__name__.split(".")[0], func._overloadname
    if name == "index":
        return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1])
    sized = (kwargs or {}).get("output_size") is not None
    return name in SHAPE_READS or (name == "repeat_interleave" and overload != "self_int" and not sized)


def copies_to_host(args, kwargs) -> bool:
    """Whether a ``_to_copy`` brings an accelerator's tensor to the host (``.cpu()``, ``.tolist()`` on a GPU)."""
    device = (kwargs or {}).get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"


def copies_from_host(name: str, args, kwargs) -> bool:
    """Whether a ``_to_copy`` or ``copy_`` brings a host tensor to a device (``.to(device)``, ``t.copy_(host)``)."""
    if name == "copy_":
        return args[0].device.type != "cpu" and args[1].device.type == "cpu"
    device = (kwargs or {}).get("device")
    return device is not None and torch.device(device).type != "cpu" and args[0].device.type == "cpu"


def profiled(function: Callable[[], Any], device: torch.device) -> dict[str, tuple[int, float]]:
    """``function()`` under ``torch.profiler``: each kernel's calls and seconds of device time on CUDA (Triton's by
    their names), elsewhere each ATen operator's calls and own CPU seconds, by name."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as watched:
        function()
        if cuda:
            torch.cuda.synchronize(device)
    attribute = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {event.key: (event.count, getattr(event, attribute) / 1e6) for event in watched.key_averages()}


def ranked(events: Mapping[str, tuple[float, float]], device: torch.device, rows: int) -> dict[str, Any]:
    """The ``rows`` largest of :func:`profiled`'s ``events`` by seconds, with their calls and shares of the total."""
    total = sum(seconds for _, seconds in events.values())
    largest = sorted(events.items(), key=lambda event: -event[1][1])[:rows]
    top = [
        {"name": name, "calls": calls, "seconds": seconds, "share": seconds / total if total else 0.0}
        for name, (calls, seconds) in largest
    ]
    return {"clock": "device" if device.type == "cuda" else "cpu", "total_seconds": total, "top": top}


def top_operators(function: Callable[[], Any], device: torch.device, rows: int) -> dict[str, Any]:
    """Where ``function()``'s time goes (:func:`profiled`): the ``rows`` largest with their calls and shares."""
    return ranked(profiled(function, device), device, rows)


class PeakMemory:
    """The process's peak memory during a block: peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``),
    else ``getrusage``'s lifetime maximum (cannot be reset: only growth shows), plus CUDA's peak allocation."""

    STATUS, CLEAR_REFS = STATUS, Path("/proc/self/clear_refs")

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = self.STATUS.exists() and os.access(self.CLEAR_REFS, os.W_OK)
        self.method = "VmHWM after clear_refs" if self.resettable else "getrusage ru_maxrss (lifetime peak)"

    def _status(self, field: str) -> int:
        if (found := status_bytes(field)) is None:
            raise KVBenchError(f"{self.STATUS} has no {field}")
        return found

    def _peak_rss(self) -> int:
        if self.resettable:
            return self._status("VmHWM")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024

    @contextmanager
    def track(self) -> Iterator[dict[str, int]]:
        """Yield a dict that is filled, on exit, with ``rss_before_bytes``, ``peak_rss_bytes``,
        ``peak_rss_delta_bytes`` (and on CUDA ``cuda_before_bytes``, ``cuda_peak_bytes``, ``cuda_peak_delta_bytes``:
        the allocator's live bytes before the block, its peak during it, and the difference)."""
        gc.collect()
        release_freed_memory()  # what the block allocates counts, not what it reuses (kvbench/allocator.py)
        if self.resettable:
            self.CLEAR_REFS.write_text("5")
        before = self._status("VmRSS") if self.STATUS.exists() else self._peak_rss()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            cuda_before = torch.cuda.memory_allocated(self.device)
        figures: dict[str, int] = {}
        yield figures
        peak = self._peak_rss()
        figures.update(rss_before_bytes=before, peak_rss_bytes=peak, peak_rss_delta_bytes=peak - before)
        if cuda:
            cuda_peak = torch.cuda.max_memory_allocated(self.device)
            figures.update(
                cuda_before_bytes=cuda_before, cuda_peak_bytes=cuda_peak, cuda_peak_delta_bytes=cuda_peak - cuda_before
            )


#: what a fresh process of :func:`fresh_process` has imported before it starts: the bench's sections, and with them
#: torch, transformers and the engine (about 5 s of a spawned process on a CPU)
PRELOADED = ["kvbench.bench.sections"]


def fresh_process() -> ProcessPoolExecutor:
    """A pool of one fresh process, whose allocator holds nothing this one freed: forked from a server that imported
    :data:`PRELOADED` and nothing else (started once a process, with the environment of that moment), or spawned where
    the platform has no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts, with the first such process
    return ProcessPoolExecutor(max_workers=1, mp_context=context)


def rotations(items: Sequence, repetition: int) -> list:
    """``items`` rotated by ``repetition``: interleaved variants take turns at every position."""
    shift = repetition % len(items) if items else 0
    return [*items[shift:], *items[:shift]]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summary(wall: list[float], cpu: list[float] | None = None) -> dict[str, Any]:
    """Per-repetition times and their medians."""
    result: dict[str, Any] = {"wall_seconds": wall, "median_wall_seconds": median(wall)}
    if cpu is not None:
        result.update(cpu_seconds=cpu, median_cpu_seconds=median(cpu))
    return result


def median_ratio(numerator: dict[str, Any], denominator: dict[str, Any], clock: str = "wall") -> float:
    """The ratio of two ``summary`` rows' medians of ``clock`` (``wall`` or ``cpu``) seconds."""
    key = f"median_{clock}_seconds"
    return numerator[key] / denominator[key]
