"""``kvbench bench``: what eviction costs and saves, measured in one process (GitHub issue 7).

Sections (``conf/bench.yaml``; a section with no prompt lengths is skipped):

* ``prefill``  — prefill time with scoring and eviction against the same prefill with ``policy=full``,
  per policy and prompt length (``prefill_overhead``: ratio of medians, wall clock; CPU-time ratios beside).
* ``decode``   — per-token decode latency at the fixed budget as the prompt grows
  (``decode_latency_ratio``: longest / shortest prompt).
* ``memory``   — KV-cache bytes and the process's peak memory (peak RSS, or CUDA peak allocation) under
  the ``chunked`` regime as the prompt grows, each figure measured in a fresh process.
* ``generate`` — kvbench's full-cache path against plain ``model.generate`` on the same prompts, both
  greedy and producing exactly ``new_tokens`` tokens (``harness_vs_generate``: tokens/s ratio).
* ``kvpress``  — kvbench's SnapKV against kvpress's ``SnapKVPress`` configured identically (same window,
  kernel, averaging, kept-token count): wall time and the Jaccard agreement of the kept token sets. It runs
  last: importing kvpress wraps every attention function registered in transformers.

The machines are shared, so every comparison is a ratio of medians over ``repetitions`` taken in this run,
with the compared variants interleaved (in a rotating order) within every repetition. CPU time
(``time.process_time``) is recorded beside wall time: another job on the cores inflates wall time, not
the CPU time this process spends. On CUDA, wall time is measured with CUDA events.
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import json
import logging
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from kvbench.engine import Engine
from kvbench.engine.models import LoadedModel, load_model
from kvbench.errors import KVBenchError, choose
from kvbench.policies import build_policy, parse_spec
from kvbench.policies.budgets import Budget

log = logging.getLogger(__name__)

PROMPT_SOURCES = ("essays", "paragraph")
#: the deterministic text of ``bench.prompt_source=paragraph`` (and the fallback when the essays are unavailable)
PARAGRAPH = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls argued over the nets, and the "
    "baker on the hill opened his shutters at six, as he had every morning for thirty years. Children ran "
    "down to the quay to count the boats, the ferry sounded its horn twice, and the clock above the town "
    "hall, which was always four minutes fast, struck the hour while the market stalls went up one by one."
)
#: issue 7's targets: prefill overhead at the longest prompt (OBCache key/joint get the looser one)
PREFILL_LIMIT, OBCACHE_PREFILL_LIMIT = 1.05, 1.10
DECODE_LIMIT, HARNESS_LIMIT, KVPRESS_LIMIT = 1.15, 0.95, 1.0


# -- measuring ------------------------------------------------------------------------------------------
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


class PeakMemory:
    """The process's peak memory during a block: peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``),
    else ``getrusage``'s lifetime maximum (cannot be reset: only growth shows), plus CUDA's peak allocation."""

    STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = self.STATUS.exists() and os.access(self.CLEAR_REFS, os.W_OK)
        self.method = "VmHWM after clear_refs" if self.resettable else "getrusage ru_maxrss (lifetime peak)"

    def _status(self, field: str) -> int:
        for line in self.STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KVBenchError(f"{self.STATUS} has no {field}")

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
            figures.update(cuda_before_bytes=cuda_before, cuda_peak_bytes=cuda_peak,
                           cuda_peak_delta_bytes=cuda_peak - cuda_before)


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


@contextmanager
def native_attention(model, backend: str) -> Iterator[None]:
    """Run ``model`` with transformers' own ``backend`` attention (kvbench engines switch it to theirs)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(backend)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def generation_config(model, config: transformers.GenerationConfig) -> Iterator[None]:
    """Make ``config`` the model's generation config for a while (e.g. one without an eos token)."""
    previous = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = previous


# -- prompts --------------------------------------------------------------------------------------------
def prompt_text(source: str) -> tuple[str, str]:
    """``(text, source used)``: the Paul Graham essays (RULER/NIAH haystack) or the fixed paragraph."""
    choose("bench.prompt_source", source, PROMPT_SOURCES)
    if source == "essays":
        from kvbench.tasks.resources import paul_graham_essays

        try:
            return paul_graham_essays(), "essays"
        except KVBenchError as error:
            log.warning("essays unavailable (%s); using the fixed paragraph", error)
            return PARAGRAPH, f"paragraph (essays unavailable: {error})"
    return PARAGRAPH, "paragraph"


def prompt_tokens(tokenizer, text: str, length: int) -> list[int]:
    """Exactly ``length`` tokens: those of the start of ``text`` (16 characters per token are ample),
    repeated as often as needed when the whole text is shorter."""
    ids = tokenizer.encode(text[: 16 * length], add_special_tokens=False, verbose=False)
    if not ids:
        raise KVBenchError("the benchmark prompt text tokenizes to nothing")
    repeats = -(-length // len(ids))
    return (ids * repeats)[:length]


# -- the benchmark --------------------------------------------------------------------------------------
class Bench:
    """One benchmark run over one loaded model, configured by the composed ``conf/bench.yaml``."""

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        self.cfg, self.loaded = cfg, loaded
        self.bench = cfg.bench
        self.budget = Budget.parse(cfg.budget.spec)
        self.repetitions = int(self.bench.repetitions)
        if self.repetitions < 1:
            raise KVBenchError(f"bench.repetitions must be >= 1, got {self.repetitions}")
        self.clock = Clock(loaded.device)
        self.memory = PeakMemory(loaded.device)
        text, self.prompt_source = prompt_text(self.bench.prompt_source)
        longest = max([*self._lengths(), 1])
        if longest > loaded.context_window:
            raise KVBenchError(f"bench prompt length {longest} exceeds {loaded.name}'s context of {loaded.context_window}")
        self.tokens = prompt_tokens(loaded.tokenizer, text, longest)
        self._engines: dict[tuple[str, str, str], Engine] = {}

    def _lengths(self) -> list[int]:
        sections = (self.bench.prefill, self.bench.decode, self.bench.memory, self.bench.generate)
        lengths = [int(length) for section in sections for length in section.prompt_lengths]
        if self.bench.kvpress.enabled:
            lengths.append(int(self.bench.kvpress.prompt_length))
        if any(length < 2 for length in lengths):
            raise KVBenchError(f"bench prompt lengths must be >= 2 tokens, got {sorted(set(lengths))}")
        return lengths

    def prompt(self, length: int) -> list[int]:
        return self.tokens[:length]

    def engine(self, spec: str, regime: str | None = None, **params) -> Engine:
        """An engine for policy ``spec`` at the budget under ``regime``: the policy's defaults, then
        ``bench.policy_params[spec]``, then ``params``."""
        regime = regime or self.cfg.engine.regime
        key = (spec, regime, json.dumps(params, sort_keys=True))
        if key not in self._engines:
            overrides = OmegaConf.to_container(self.bench.policy_params, resolve=True).get(spec, {})
            self._engines[key] = Engine(
                self.loaded.model,
                build_policy(spec, {**overrides, **params}),
                self.budget,
                regime=regime,
                block_size=self.cfg.engine.block_size,
                decode_evict=self.cfg.engine.decode_evict,
                attn_backend=self.loaded.attn_backend,
                score_block=self.cfg.engine.score_block,
            )
        return self._engines[key]

    def warm_up(self) -> None:
        """One untimed prefill per engine kind (thread pools, allocator, kernel selection)."""
        tokens = min(int(self.bench.warmup_tokens), len(self.tokens))
        if tokens >= 2:
            for spec in ("full", "snapkv"):
                self.engine(spec).generate(self.prompt(tokens), 2)

    # -- sections -------------------------------------------------------------------------------------
    def prefill(self) -> dict[str, Any]:
        """Prefill (scoring + eviction) time per policy and prompt length, against ``full``, interleaved."""
        section = self.bench.prefill
        policies = ["full", *[str(spec) for spec in section.policies if str(spec) != "full"]]
        lengths = [int(length) for length in section.prompt_lengths]
        wall = {spec: {length: [] for length in lengths} for spec in policies}
        cpu = {spec: {length: [] for length in lengths} for spec in policies}
        kv: dict[str, dict[str, Any]] = {spec: {} for spec in policies}
        for repetition in range(self.repetitions):
            for length in lengths:
                for spec in rotations(policies, repetition):
                    prefill = functools.partial(self.engine(spec).generate, self.prompt(length), 1)
                    seconds, cpu_seconds, output = self.clock.measure(prefill)
                    wall[spec][length].append(seconds)
                    cpu[spec][length].append(cpu_seconds)
                    if repetition == 0:
                        kv[spec][str(length)] = self.kv_bytes(self.engine(spec), output.kv, length)
                log.info("prefill repetition %d, %d tokens done", repetition + 1, length)
        raw = {spec: {str(n): summary(wall[spec][n], cpu[spec][n]) for n in lengths} for spec in policies}

        def ratios(clock: str) -> dict[str, dict[str, float]]:
            key = f"median_{clock}_seconds"
            return {
                spec: {str(n): raw[spec][str(n)][key] / raw["full"][str(n)][key] for n in lengths}
                for spec in policies
                if spec != "full"
            }

        return {"overhead": ratios("wall"), "overhead_cpu": ratios("cpu"), "raw": raw, "kv_bytes": kv}

    def kv_bytes(self, engine: Engine, stats, prompt_len: int) -> dict[str, Any]:
        """KV-cache bytes after prefill and at peak against the full cache of the prompt."""
        config = self.loaded.model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = engine.num_query_heads if engine.policy.gqa == "repeat" else engine.num_kv_heads
        per_token = 2 * head_dim * self.loaded.dtype.itemsize  # keys + values, one head, one layer
        after = sum(stats.after_prefill_tokens_per_layer) * heads * per_token
        full = prompt_len * engine.num_layers * engine.num_kv_heads * per_token
        return {
            "after_prefill_bytes": after,
            "peak_bytes": stats.peak_bytes,
            "full_bytes": full,
            "after_prefill_ratio": after / full,
            "peak_ratio": stats.peak_bytes / full,
            "after_prefill_tokens_per_layer": stats.after_prefill_tokens_per_layer,
        }

    def decode(self) -> dict[str, Any]:
        """Per-token decode latency of ``bench.decode.policy`` at the budget as the prompt grows.

        Every decode forward is timed (wall and CPU) and the medians are taken over all steps of all
        repetitions, which a burst of load on a shared machine hardly moves; ``generate_mean_seconds``
        is the engine's own ``decode_seconds`` per step, for reference."""
        section = self.bench.decode
        lengths = [int(length) for length in section.prompt_lengths]
        new_tokens = int(section.new_tokens)
        if new_tokens < 2:
            raise KVBenchError(f"bench.decode.new_tokens must be >= 2 (one decode step), got {new_tokens}")
        engine = self.engine(str(section.policy))
        steps = {length: {"wall": [], "cpu": [], "generate": []} for length in lengths}
        for repetition in range(self.repetitions):
            for length in rotations(lengths, repetition):
                with self.clock.forwards(self.loaded.model) as forwards:
                    output = engine.generate(self.prompt(length), new_tokens)
                decode_steps = forwards[-(new_tokens - 1) :]  # the prefill forwards come first
                steps[length]["wall"] += [wall for wall, _ in decode_steps]
                steps[length]["cpu"] += [cpu for _, cpu in decode_steps]
                steps[length]["generate"].append(output.decode_seconds / (len(output.token_ids) - 1))
        raw = {
            str(n): {**summary(steps[n]["wall"], steps[n]["cpu"]), "generate_mean_seconds": steps[n]["generate"]}
            for n in lengths
        }
        longest, shortest = raw[str(max(lengths))], raw[str(min(lengths))]
        return {
            "policy": engine.policy.spec,
            "budget": str(self.budget.spec),
            "regime": engine.regime,
            "new_tokens": new_tokens,
            "per_token_seconds": raw,
            "ratio": longest["median_wall_seconds"] / shortest["median_wall_seconds"],
            "ratio_cpu": longest["median_cpu_seconds"] / shortest["median_cpu_seconds"],
        }

    def memory_section(self) -> dict[str, Any]:
        """KV bytes and peak process memory per policy under ``bench.memory.regime`` as the prompt grows, each
        row in a fresh process (the allocator of this one keeps what earlier sections freed)."""
        section = self.bench.memory
        lengths = sorted(int(length) for length in section.prompt_lengths)
        method = f"{self.memory.method}, one fresh process per row"
        result: dict[str, Any] = {"regime": str(section.regime), "method": method, "policies": {}}
        config = OmegaConf.to_container(self.cfg, resolve=True)
        for spec in section.policies:
            rows = {}
            for length in lengths:
                with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    canonical, rows[str(length)] = pool.submit(memory_row, config, str(spec), length).result()
            result["policies"][canonical] = rows
        process_peaks = {"peak_rss_delta_bytes": "peak_rss_added_bytes", "cuda_peak_delta_bytes": "cuda_peak_added_bytes"}
        result["growth"] = {}
        for spec, rows in result["policies"].items():
            shortest, longest = rows[str(lengths[0])], rows[str(lengths[-1])]
            growth = {"peak_bytes": longest["peak_bytes"] / max(shortest["peak_bytes"], 1)}
            for key, added in process_peaks.items():
                if key in longest:
                    growth[key] = longest[key] / max(shortest[key], 1)
                    growth[added] = longest[key] - shortest[key]
            result["growth"][spec] = growth
        return result

    def generate(self) -> dict[str, Any]:
        """kvbench's full cache against ``model.generate`` (greedy, exactly ``new_tokens`` each), interleaved."""
        section = self.bench.generate
        lengths = [int(length) for length in section.prompt_lengths]
        new_tokens = int(section.new_tokens)
        model, engine = self.loaded.model, self.engine("full")
        # no eos: a generation config passed to generate() inherits the model's eos, so it is swapped instead
        config = transformers.GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=self.loaded.tokenizer.pad_token_id
        )
        times = {(variant, n): [] for variant in ("kvbench", "generate") for n in lengths}
        cpu_times = {(variant, n): [] for variant in ("kvbench", "generate") for n in lengths}
        match = {}

        def run_kvbench(ids: list[int]) -> list[int]:
            return engine.generate(ids, new_tokens).token_ids

        def run_generate(ids: list[int]) -> list[int]:
            prompt = torch.tensor([ids], device=self.loaded.device)
            with native_attention(model, self.loaded.attn_backend), generation_config(model, config), torch.inference_mode():
                output = model.generate(prompt)
            return output[0, len(ids) :].tolist()

        variants = {"kvbench": run_kvbench, "generate": run_generate}
        for repetition in range(self.repetitions):
            for length in lengths:
                tokens = {}
                for variant in rotations(list(variants), repetition):
                    call = functools.partial(variants[variant], self.prompt(length))
                    seconds, cpu_seconds, tokens[variant] = self.clock.measure(call)
                    if len(tokens[variant]) != new_tokens:
                        raise KVBenchError(f"{variant} produced {len(tokens[variant])} tokens, not {new_tokens}")
                    times[variant, length].append(seconds)
                    cpu_times[variant, length].append(cpu_seconds)
                match[str(length)] = tokens["kvbench"] == tokens["generate"]
        raw = {str(n): {v: summary(times[v, n], cpu_times[v, n]) for v in variants} for n in lengths}

        def speed_ratio(rows: list[dict[str, Any]], clock: str) -> float:
            """Generate's summed median time ÷ kvbench's: kvbench tokens/s ÷ generate tokens/s."""
            key = f"median_{clock}_seconds"
            return sum(row["generate"][key] for row in rows) / sum(row["kvbench"][key] for row in rows)

        for row in raw.values():
            row["speed_ratio"], row["speed_ratio_cpu"] = speed_ratio([row], "wall"), speed_ratio([row], "cpu")
        return {
            "new_tokens": new_tokens,
            "per_prompt": raw,
            "same_tokens": match,
            "speed_ratio": speed_ratio(list(raw.values()), "wall"),
            "speed_ratio_cpu": speed_ratio(list(raw.values()), "cpu"),
        }

    def kvpress(self) -> dict[str, Any]:
        """kvbench's SnapKV against kvpress's ``SnapKVPress`` on one prompt, or ``{"skipped": reason}``."""
        try:
            import kvpress
        except ImportError as error:
            return {"skipped": f"kvpress is not importable ({error}); pip install 'kvbench[kvpress]'"}
        try:
            return self._kvpress(kvpress)
        except (AssertionError, AttributeError, KeyError, RuntimeError, TypeError, ValueError) as error:
            # kvpress releases pin narrow transformers ranges; API drift surfaces as one of these
            version = importlib.metadata.version("kvpress")
            return {"skipped": f"kvpress {version} failed with transformers {transformers.__version__}: {error!r}"}

    def _kvpress(self, kvpress) -> dict[str, Any]:
        section = self.bench.kvpress
        length, window, kernel = int(section.prompt_length), int(section.window), int(section.kernel)
        kept_tokens = self.budget.resolve(length)
        if not window < kept_tokens < length:
            raise KVBenchError(f"kvpress comparison needs window {window} < kept tokens {kept_tokens} < prompt {length}")
        ids = self.prompt(length)
        model, device = self.loaded.model, self.loaded.device
        # SnapKVPress: mean over the window and over each GQA group, avg pooling over the prefix, window kept
        engine = self.engine("snapkv", window=window, kernel=kernel, pool="avg", gqa="mean")
        press = kvpress.SnapKVPress(compression_ratio=1.0 - kept_tokens / length, window_size=window, kernel_size=kernel)
        scores: dict[int, torch.Tensor] = {}
        score = press.score

        def recording_score(module, *args, **kwargs):
            scores[module.layer_idx] = result = score(module, *args, **kwargs)
            return result

        press.score = recording_score

        def run_kvbench():
            with torch.inference_mode():
                cache = engine.new_cache(length)
                engine.prefill(cache, ids)
            return cache

        def run_kvpress():
            cache = transformers.DynamicCache(config=model.config)
            with native_attention(model, self.loaded.attn_backend), torch.inference_mode(), press(model):
                # kvpress's hook reads cache_position, which transformers 5 no longer passes to attention
                model(
                    input_ids=torch.tensor([ids], device=device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    cache_position=torch.arange(length, device=device),
                )
            return cache

        times: dict[str, list[float]] = {"kvbench": [], "kvpress": []}
        caches: dict[str, Any] = {}
        variants = {"kvbench": run_kvbench, "kvpress": run_kvpress}
        for repetition in range(self.repetitions):
            for variant in rotations(list(variants), repetition):
                seconds, _, caches[variant] = self.clock.measure(variants[variant])
                times[variant].append(seconds)
        jaccard = []
        for layer_idx, layer in enumerate(caches["kvbench"].layers):
            press_kept = scores[layer_idx].topk(caches["kvpress"].layers[layer_idx].keys.shape[2], dim=-1).indices
            mine = torch.zeros(layer.positions.shape[:-1] + (length,), dtype=torch.bool, device=device)
            mine.scatter_(-1, layer.positions, True)
            theirs = torch.zeros_like(mine).scatter_(-1, press_kept, True)
            jaccard.append(((mine & theirs).sum(-1) / (mine | theirs).sum(-1)).flatten().tolist())
        per_layer = [statistics.fmean(heads) for heads in jaccard]
        raw = {variant: summary(seconds) for variant, seconds in times.items()}
        return {
            "version": importlib.metadata.version("kvpress"),
            "prompt_length": length,
            "kept_tokens": kept_tokens,
            "kvpress_kept_tokens": caches["kvpress"].layers[0].keys.shape[2],
            "window": window,
            "kernel": kernel,
            "times": raw,
            "speed_ratio": raw["kvpress"]["median_wall_seconds"] / raw["kvbench"]["median_wall_seconds"],
            "jaccard_mean": statistics.fmean(per_layer),
            "jaccard_min": min(min(heads) for heads in jaccard),
            "jaccard_per_layer": per_layer,
        }

    # -- the whole run --------------------------------------------------------------------------------
    def run(self, out: Path) -> dict[str, Any]:
        """All sections; ``bench.json`` and ``bench.md`` in ``out`` are rewritten after each one (a long run
        that is interrupted keeps what it measured). Returns the ``bench.json`` document."""
        started = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        results: dict[str, Any] = {"prefill_overhead": {}, "prefill_overhead_cpu": {}, "decode_latency_ratio": None}
        results.update(harness_vs_generate=None, kv_bytes={}, memory={}, raw={})

        def save() -> None:
            results["targets"] = targets(results)
            results["machine"] = machine(self.loaded)
            results["prompt_source"] = self.prompt_source
            results["config"] = OmegaConf.to_container(self.cfg, resolve=True)
            results["elapsed_seconds"] = time.perf_counter() - started
            (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
            (out / "bench.md").write_text(markdown(results))

        self.warm_up()
        if self.bench.prefill.prompt_lengths:
            log.info("prefill overhead")
            prefill = self.prefill()
            results.update(prefill_overhead=prefill["overhead"], prefill_overhead_cpu=prefill["overhead_cpu"])
            results.update(kv_bytes=prefill["kv_bytes"])
            results["raw"]["prefill"] = prefill["raw"]
            save()
        if self.bench.decode.prompt_lengths:
            log.info("decode latency")
            decode = self.decode()
            results["decode_latency_ratio"] = decode["ratio"]
            results["raw"]["decode"] = decode
            save()
        if self.bench.memory.prompt_lengths and self.bench.memory.policies:
            log.info("memory")
            results["memory"] = self.memory_section()
            save()
        if self.bench.generate.prompt_lengths:
            log.info("kvbench vs model.generate")
            generate = self.generate()
            results["harness_vs_generate"] = generate["speed_ratio"]
            results["raw"]["generate"] = generate
            save()
        if self.bench.kvpress.enabled:
            log.info("kvpress")
            results["kvpress"] = self.kvpress()
        save()
        return results


def memory_row(config: dict[str, Any], spec: str, length: int) -> tuple[str, dict[str, Any]]:
    """One row of the memory section, run in a spawned process: the model is loaded, then the peak RSS of one
    ``generate`` over a ``length``-token prompt is measured, after a two-token one that pages in the memory-mapped
    weights. Returns the canonical spec and the row."""
    cfg = OmegaConf.create(config)
    bench = Bench(cfg, load_model(cfg.model))
    engine = bench.engine(spec, regime=str(cfg.bench.memory.regime))
    engine.generate(bench.prompt(2), 1)
    with bench.memory.track() as figures:
        output = engine.generate(bench.prompt(length), int(cfg.bench.memory.new_tokens))
    return engine.policy.spec, {**figures, **bench.kv_bytes(engine, output.kv, length)}


def targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 7's targets against the measured figures: ``{name: {value, limit, met}}``."""
    found: dict[str, dict[str, Any]] = {}

    def check(name: str, value: float | None, limit: float, at_most: bool = True) -> None:
        if value is not None:
            found[name] = {"value": value, "limit": limit, "met": value <= limit if at_most else value >= limit}

    for spec, by_length in results["prefill_overhead"].items():
        longest = max(by_length, key=int)
        _, modifiers = parse_spec(spec)
        limit = OBCACHE_PREFILL_LIMIT if {"obcache_key", "obcache_joint"} & set(modifiers) else PREFILL_LIMIT
        check(f"prefill_overhead[{spec}]@{longest}", by_length[longest], limit)
    check("decode_latency_ratio", results["decode_latency_ratio"], DECODE_LIMIT)
    check("harness_vs_generate", results["harness_vs_generate"], HARNESS_LIMIT, at_most=False)
    check("kvpress_speed_ratio", results.get("kvpress", {}).get("speed_ratio"), KVPRESS_LIMIT, at_most=False)
    return found


def machine(loaded: LoadedModel) -> dict[str, Any]:
    """Where the figures were measured."""
    device = loaded.device
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "attn_backend": loaded.attn_backend,
    }


# -- output ---------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def markdown(results: dict[str, Any]) -> str:
    """``bench.md``: the figures of ``bench.json`` as Markdown tables."""
    info, config = results["machine"], results["config"]
    lines = [
        f"# kvbench bench — {info['model']} ({info['dtype']}, {info['attn_backend']}) on {info['device']}",
        "",
        (
            f"{info['platform']}, {info['cpu_count']} CPUs ({info['torch_threads']} torch threads), torch "
            f"{info['torch']}, transformers {info['transformers']}; load average at the end {info['load_average']}. "
            f"Budget {config['budget']['spec']}, regime {config['engine']['regime']}, "
            f"{config['bench']['repetitions']} repetitions (medians), prompts: {results['prompt_source']}; "
            f"{results['elapsed_seconds']:.0f} s."
        ),
    ]
    overhead, cpu = results["prefill_overhead"], results["prefill_overhead_cpu"]
    if overhead:
        lengths = list(next(iter(overhead.values())))
        full = results["raw"]["prefill"]["full"]
        lines += ["", "## Prefill with scoring + eviction ÷ full-cache prefill (wall; CPU time in brackets)", ""]
        rows = [["full (seconds)", *(f"{full[n]['median_wall_seconds']:.2f} ({full[n]['median_cpu_seconds']:.2f})" for n in lengths)]]
        rows += [[spec, *(f"{ratios[n]:.3f} ({cpu[spec][n]:.3f})" for n in lengths)] for spec, ratios in overhead.items()]
        lines += _table(["policy", *(f"{n} tokens" for n in lengths)], rows)
    if results["kv_bytes"]:
        lines += ["", "## KV-cache bytes at the longest prefill prompt (MiB)", ""]
        rows = []
        for spec, by_length in results["kv_bytes"].items():
            longest = max(by_length, key=int)
            row = by_length[longest]
            rows.append([spec, longest, _mib(row["after_prefill_bytes"]), _mib(row["peak_bytes"]), _mib(row["full_bytes"]),
                         f"{row['after_prefill_ratio']:.3f}"])
        lines += _table(["policy", "prompt", "after prefill", "peak", "full cache", "after/full"], rows)
    decode = results["raw"].get("decode")
    if decode:
        lines += ["", f"## Decode latency per token, {decode['policy']} at budget {decode['budget']} ({decode['regime']})", ""]
        rows = [[n, f"{row['median_wall_seconds'] * 1000:.2f}", f"{row['median_cpu_seconds'] * 1000:.2f}"]
                for n, row in decode["per_token_seconds"].items()]
        lines += _table(["prompt", "ms/token (wall)", "CPU ms/token"], rows)
        lines += ["", f"longest / shortest: **{results['decode_latency_ratio']:.3f}** (CPU time: {decode['ratio_cpu']:.3f})"]
    memory = results["memory"]
    if memory:
        lines += ["", f"## Memory, {memory['regime']} regime ({memory['method']}; MiB)", ""]
        cuda = all("cuda_peak_bytes" in row for rows in memory["policies"].values() for row in rows.values())
        header = ["policy", "prompt", "peak RSS", "peak RSS − before", "KV peak", "full KV"]
        header += ["CUDA peak", "CUDA peak − before"] if cuda else []
        rows = []
        for spec, by_length in memory["policies"].items():
            for n, row in by_length.items():
                rows.append([spec, n, _mib(row["peak_rss_bytes"]), _mib(row["peak_rss_delta_bytes"]),
                             _mib(row["peak_bytes"]), _mib(row["full_bytes"])])
                rows[-1] += [_mib(row["cuda_peak_bytes"]), _mib(row["cuda_peak_delta_bytes"])] if cuda else []
        lines += _table(header, rows)
        growth = ", ".join(f"{spec} ×{row['peak_rss_delta_bytes']:.2f}, {_mib(row['peak_rss_added_bytes'])} MiB more"
                           f" (KV peak ×{row['peak_bytes']:.2f})"
                           for spec, row in memory["growth"].items())
        lines += ["", f"growth from the shortest to the longest prompt, peak RSS − before: {growth}"]
        if cuda:
            growth = ", ".join(f"{spec} ×{row['cuda_peak_delta_bytes']:.2f}, {_mib(row['cuda_peak_added_bytes'])} MiB more"
                               for spec, row in memory["growth"].items())
            lines += ["", f"growth of the CUDA peak − before: {growth}"]
    generate = results["raw"].get("generate")
    if generate:
        lines += ["", f"## kvbench full cache vs model.generate ({generate['new_tokens']} new tokens, seconds)", ""]
        rows = [[n, f"{row['kvbench']['median_wall_seconds']:.2f}", f"{row['generate']['median_wall_seconds']:.2f}",
                 f"{row['speed_ratio']:.3f}", f"{row['speed_ratio_cpu']:.3f}", generate["same_tokens"][n]]
                for n, row in generate["per_prompt"].items()]
        lines += _table(["prompt", "kvbench", "generate", "speed ratio", "speed ratio (CPU)", "same tokens"], rows)
        ratio = f"**{results['harness_vs_generate']:.3f}** (CPU time: {generate['speed_ratio_cpu']:.3f})"
        lines += ["", f"overall speed ratio (kvbench tokens/s ÷ generate tokens/s): {ratio}"]
    if "kvpress" in results:
        press = results["kvpress"]
        lines += ["", "## kvbench SnapKV vs kvpress SnapKVPress", ""]
        if "skipped" in press:
            lines.append(f"skipped: {press['skipped']}")
        else:
            lines += _table(
                ["kvpress", "prompt", "kept", "kvbench s", "kvpress s", "speed ratio", "Jaccard mean", "Jaccard min"],
                [[press["version"], press["prompt_length"], press["kept_tokens"],
                  f"{press['times']['kvbench']['median_wall_seconds']:.2f}",
                  f"{press['times']['kvpress']['median_wall_seconds']:.2f}", f"{press['speed_ratio']:.3f}",
                  f"{press['jaccard_mean']:.4f}", f"{press['jaccard_min']:.4f}"]],
            )
    if results["targets"]:
        lines += ["", "## Issue 7 targets", ""]
        rows = [[name, f"{row['value']:.3f}", row["limit"], "yes" if row["met"] else "**no**"]
                for name, row in results["targets"].items()]
        lines += _table(["figure", "measured", "limit", "met"], rows)
    return "\n".join(lines) + "\n"


def output_directory(cfg: DictConfig) -> Path:
    """``output_dir``, or ``results/bench/<timestamp>``."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("results") / "bench" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def run_bench(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    """Run the benchmark configured by ``cfg`` into ``bench.json`` and ``bench.md``; the results and their folder."""
    for spec in [*cfg.bench.prefill.policies, *cfg.bench.memory.policies, cfg.bench.decode.policy]:
        parse_spec(str(spec))
    from kvbench.engine import REGIMES

    for key, regime in (("engine.regime", cfg.engine.regime), ("bench.memory.regime", cfg.bench.memory.regime)):
        choose(key, regime, REGIMES)
    out = output_directory(cfg)
    return Bench(cfg, load_model(cfg.model)).run(out), out
