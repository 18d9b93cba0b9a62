"""``kvbench bench``: what eviction costs and saves, measured in one process (README, Benchmarks).

* ``measure``  — clocks (CUDA events on CUDA), peak memory, interleaving and medians;
* ``sections`` — the prefill, decode, memory and generate sections over one loaded model;
* ``kvpress``  — kvbench's SnapKV against kvpress's ``SnapKVPress``;
* ``report``   — the targets, the machine and ``bench.md``;
* ``runner``   — the whole run into ``bench.json`` and ``bench.md`` (``run_bench``, the CLI's entry).
"""

from kvbench.bench.runner import run_bench

__all__ = ["run_bench"]
