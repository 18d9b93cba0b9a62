"""The sections of ``kvbench bench`` over one loaded model (``conf/bench.yaml``; a section with no prompt
lengths is skipped):

* ``prefill``  — prefill time with scoring and eviction against the same prefill with ``policy=full``,
  per policy and prompt length (``prefill_overhead``: ratio of medians, wall clock; CPU-time ratios beside),
  and the operators a prefill of the shortest prompt dispatches and the values it reads back (``prefill_operators``:
  on a GPU the kernel launches and host synchronisations, counted the same on any device).
* ``decode``   — per-token decode latency at the fixed budget as the prompt grows
  (``decode_latency_ratio``: longest / shortest prompt).
* ``memory``   — KV-cache bytes and the process's peak memory (peak RSS, or CUDA peak allocation) under
  the ``chunked`` regime as the prompt grows, each figure measured in a fresh process.
* ``generate`` — kvbench's full-cache path against plain ``model.generate`` on the same prompts, both
  greedy and producing exactly ``new_tokens`` tokens (``harness_vs_generate``: tokens/s ratio).

The engine is used through its public API only (``Engine.generate``, ``new_cache``, ``prefill``).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from kvbench import config_dict
from kvbench.bench.measure import (
    Clock,
    Operators,
    PeakMemory,
    fresh_process,
    median_ratio,
    rotations,
    summary,
    top_operators,
)
from kvbench.budgets import Budget
from kvbench.engine import Engine
from kvbench.errors import KVBenchError, choose
from kvbench.models import LoadedModel, ModelSpec, load_model
from kvbench.policies import build_policy

log = logging.getLogger(__name__)

PROMPT_SOURCES = ("essays", "paragraph")
#: the deterministic text of ``bench.prompt_source=paragraph`` (and the fallback when the essays are unavailable)
PARAGRAPH = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls argued over the nets, and the "
    "baker on the hill opened his shutters at six, as he had every morning for thirty years. Children ran "
    "down to the quay to count the boats, the ferry sounded its horn twice, and the clock above the town "
    "hall, which was always four minutes fast, struck the hour while the market stalls went up one by one."
)


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


def bench_text(source: str) -> tuple[str, str]:
    """``(text, source used)``: the Paul Graham essays (RULER/NIAH haystack) or the fixed paragraph."""
    choose("bench.prompt_source", source, PROMPT_SOURCES)
    if source == "essays":
        from kvbench.resources import paul_graham_essays

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


class Bench:
    """One benchmark run over one loaded model, configured by the composed ``conf/bench.yaml``. Each section
    (``prefill``, ``decode``, ``memory_section``, ``generate``) returns its fields of ``bench.json``, its raw
    figures under ``raw``."""

    def __init__(self, cfg: DictConfig, loaded: LoadedModel):
        self.cfg, self.loaded = cfg, loaded
        self.bench = cfg.bench
        self.budget = Budget.parse(cfg.budget.spec)
        self.repetitions = int(self.bench.repetitions)  # each setting in its domain (kvbench/bench/settings.py)
        self.clock = Clock(loaded.device)
        self.memory = PeakMemory(loaded.device)
        text, self.prompt_source = bench_text(self.bench.prompt_source)
        longest = max([*self._lengths(), 1])
        if longest > loaded.context_window:
            raise KVBenchError(
                f"bench prompt length {longest} exceeds {loaded.name}'s context window of {loaded.context_window}"
            )
        self.tokens = prompt_tokens(loaded.tokenizer, text, longest)
        self._engines: dict[tuple[str, str, str | None, str], Engine] = {}

    def _lengths(self) -> list[int]:
        sections = (self.bench.prefill, self.bench.decode, self.bench.memory, self.bench.generate)
        lengths = [int(length) for section in sections for length in section.prompt_lengths]
        if self.bench.headwise.policies:
            lengths.append(int(self.bench.headwise.prompt_length))
        if self.bench.kvpress.enabled:
            lengths.append(int(self.bench.kvpress.prompt_length))
        if self.bench.grid.policies and self.bench.grid.budgets:
            lengths.append(int(self.bench.grid.context_length))
        if self.bench.grid_operators.context_length:
            lengths.append(int(self.bench.grid_operators.context_length))
        return lengths

    def prompt(self, length: int) -> list[int]:
        return self.tokens[:length]

    def engine(self, spec: str, regime: str | None = None, budget: str | None = None, **params) -> Engine:
        """An engine for policy ``spec`` at ``budget`` (default the bench's) under ``regime``: the policy's defaults,
        then ``bench.policy_params[spec]``, then ``params``."""
        regime = regime or self.cfg.engine.regime
        key = (spec, regime, budget, json.dumps(params, sort_keys=True))
        if key not in self._engines:
            overrides = config_dict(self.bench.policy_params, resolve=True).get(spec, {})
            self._engines[key] = Engine(
                self.loaded.model,
                build_policy(spec, {**overrides, **params}),
                self.budget if budget is None else Budget.parse(budget),
                regime=regime,
                block_size=self.cfg.engine.block_size,
                decode_evict=self.cfg.engine.decode_evict,
                attn_backend=self.loaded.attn_backend,
                score_block=self.cfg.engine.score_block,
                sums_kernel=self.cfg.engine.sums_kernel,
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
        wall: dict[str, dict[int, list[float]]] = {spec: {length: [] for length in lengths} for spec in policies}
        cpu: dict[str, dict[int, list[float]]] = {spec: {length: [] for length in lengths} for spec in policies}
        kv: dict[str, dict[str, Any]] = {spec: {} for spec in policies}
        if self.clock.cuda:  # one untimed prefill of each: Triton's compilation and tuning, the libraries' heuristics
            for length in lengths:
                for spec in policies:
                    self.engine(spec).generate(self.prompt(length), 1)
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
        shortest = min(lengths)  # untimed, at the shortest prompt: each operator goes through Python
        operators = {spec: self.operators(spec, shortest) for spec in policies}
        for row in operators.values():
            row["ratio"] = row["operators"] / operators["full"]["operators"]

        def ratios(clock: str) -> dict[str, dict[str, float]]:
            return {
                spec: {str(n): median_ratio(raw[spec][str(n)], raw["full"][str(n)], clock) for n in lengths}
                for spec in policies
                if spec != "full"
            }

        longest = max(lengths)  # untimed, after the timed repetitions: the profiler slows what it watches
        profiled = [str(spec) for spec in section.profile]
        profiles = {
            spec: top_operators(
                functools.partial(self.engine(spec).generate, self.prompt(longest), 1),
                self.clock.device,
                int(section.profile_rows),
            )
            for spec in (["full", *profiled] if profiled else [])
        }
        return {
            "prefill_overhead": ratios("wall"),
            "prefill_overhead_cpu": ratios("cpu"),
            "prefill_operators": {"prompt_length": shortest, "by_policy": operators},
            "prefill_profile": {"prompt_length": longest, "by_policy": profiles} if profiles else {},
            "kv_bytes": kv,
            "raw": {"prefill": raw},
        }

    def operators(self, spec: str, length: int) -> dict[str, Any]:
        """The operators one prefill of ``length`` tokens dispatches and the values it reads back
        (:class:`~kvbench.bench.measure.Operators`): kernel launches and host synchronisations on a GPU."""
        with Operators() as counted:
            self.engine(spec).generate(self.prompt(length), 1)
        return counted.figures()

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
        engine = self.engine(str(section.policy))
        steps: dict[int, dict[str, list[float]]] = {
            length: {"wall": [], "cpu": [], "generate": []} for length in lengths
        }
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
        ratio = median_ratio(longest, shortest)
        return {
            "decode_latency_ratio": ratio,
            "raw": {
                "decode": {
                    "policy": engine.policy.spec,
                    "budget": str(self.budget.spec),
                    "regime": engine.regime,
                    "new_tokens": new_tokens,
                    "per_token_seconds": raw,
                    "ratio": ratio,
                    "ratio_cpu": median_ratio(longest, shortest, "cpu"),
                }
            },
        }

    def headwise(self) -> dict[str, Any]:
        """A length per head against the same scorer per layer at the same total budget, on one prompt of
        ``bench.headwise.prompt_length``: the KV bytes each holds after prefill (and what padding every head to the
        longest would hold) and the per-token decode latency (every decode forward timed, medians over the
        repetitions, the variants interleaved). The first policy is the per-layer reference."""
        section = self.bench.headwise
        policies, length = [str(spec) for spec in section.policies], int(section.prompt_length)
        new_tokens = int(section.new_tokens)
        steps: dict[str, dict[str, list[float]]] = {spec: {"wall": [], "cpu": []} for spec in policies}
        held: dict[str, dict[str, Any]] = {}
        for repetition in range(self.repetitions):
            for spec in rotations(policies, repetition):
                engine = self.engine(spec)
                with self.clock.forwards(self.loaded.model) as forwards:
                    output = engine.generate(self.prompt(length), new_tokens)
                steps[spec]["wall"] += [wall for wall, _ in forwards[-(new_tokens - 1) :]]
                steps[spec]["cpu"] += [cpu for _, cpu in forwards[-(new_tokens - 1) :]]
                ranges = output.kv.after_prefill_head_range
                longest = output.kv.after_prefill_tokens_per_layer if ranges is None else [high for _, high in ranges]
                per_head = output.kv.after_prefill_bytes // max(sum(output.kv.after_prefill_tokens_per_layer), 1)
                held[spec] = {
                    "after_prefill_bytes": output.kv.after_prefill_bytes,
                    "padded_bytes": sum(longest) * per_head,
                    "head_range": ranges,
                }
        raw = {spec: summary(steps[spec]["wall"], steps[spec]["cpu"]) for spec in policies}
        reference = policies[0]
        compared = {
            spec: {
                "kv_bytes_ratio": held[spec]["after_prefill_bytes"] / held[reference]["after_prefill_bytes"],
                "padded_bytes_ratio": held[spec]["padded_bytes"] / held[reference]["after_prefill_bytes"],
                "decode_ratio": median_ratio(raw[spec], raw[reference]),
                "decode_ratio_cpu": median_ratio(raw[spec], raw[reference], "cpu"),
            }
            for spec in policies[1:]
        }
        return {
            "headwise": {"reference": reference, "prompt_length": length, "budget": str(self.budget.spec), **compared},
            "raw": {"headwise": {"held": held, "per_token_seconds": raw, "new_tokens": new_tokens}},
        }

    def memory_section(self) -> dict[str, Any]:
        """KV bytes and peak process memory per policy under ``bench.memory.regime`` as the prompt grows, each
        row in a fresh process (the allocator of this one keeps what earlier sections freed)."""
        section = self.bench.memory
        lengths = sorted(int(length) for length in section.prompt_lengths)
        method = f"{self.memory.method}, one fresh process per row"
        result: dict[str, Any] = {"regime": str(section.regime), "method": method, "policies": {}}
        config = config_dict(self.cfg, resolve=True)
        for spec in section.policies:
            rows = {}
            for length in lengths:
                with fresh_process() as pool:
                    canonical, rows[str(length)] = pool.submit(memory_section_row, config, str(spec), length).result()
            result["policies"][canonical] = rows
        process_peaks = {
            "peak_rss_delta_bytes": "peak_rss_added_bytes",
            "cuda_peak_delta_bytes": "cuda_peak_added_bytes",
        }
        result["growth"] = {}
        for spec, rows in result["policies"].items():
            shortest, longest = rows[str(lengths[0])], rows[str(lengths[-1])]
            growth = {"peak_bytes": longest["peak_bytes"] / max(shortest["peak_bytes"], 1)}
            for key, added in process_peaks.items():
                if key in longest:
                    growth[key] = longest[key] / max(shortest[key], 1)
                    growth[added] = longest[key] - shortest[key]
            result["growth"][spec] = growth
        return {"memory": result}

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
        times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in ("kvbench", "generate") for n in lengths}
        cpu_times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in ("kvbench", "generate") for n in lengths}
        match = {}

        def run_kvbench(ids: list[int]) -> list[int]:
            return engine.generate(ids, new_tokens).token_ids

        def run_generate(ids: list[int]) -> list[int]:
            prompt = torch.tensor([ids], device=self.loaded.device)
            with (
                native_attention(model, self.loaded.attn_backend),
                generation_config(model, config),
                torch.inference_mode(),
            ):
                output = cast(Any, model).generate(prompt)  # a causal LM (transformers types generate oddly)
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
        raw: dict[str, dict[str, Any]] = {
            str(n): {v: summary(times[v, n], cpu_times[v, n]) for v in variants} for n in lengths
        }

        def speed_ratio(rows: list[dict[str, Any]], clock: str) -> float:
            """Generate's summed median time ÷ kvbench's: kvbench tokens/s ÷ generate tokens/s."""
            key = f"median_{clock}_seconds"
            return sum(row["generate"][key] for row in rows) / sum(row["kvbench"][key] for row in rows)

        for row in raw.values():
            row["speed_ratio"], row["speed_ratio_cpu"] = speed_ratio([row], "wall"), speed_ratio([row], "cpu")
        ratio = speed_ratio(list(raw.values()), "wall")
        generate = {"new_tokens": new_tokens, "per_prompt": raw, "same_tokens": match, "speed_ratio": ratio}
        generate["speed_ratio_cpu"] = speed_ratio(list(raw.values()), "cpu")
        return {"harness_vs_generate": ratio, "raw": {"generate": generate}}


def memory_section_row(config: dict[str, Any], spec: str, length: int) -> tuple[str, dict[str, Any]]:
    """One row of the memory section, run in a fresh process (:func:`fresh_process`): the model is loaded, then the
    peak RSS of one ``generate`` over a ``length``-token prompt is measured, after a two-token one that pages in the
    memory-mapped weights. Returns the canonical spec and the row."""
    cfg = OmegaConf.create(config)
    bench = Bench(cfg, load_model(ModelSpec.of(cfg.model)))
    engine = bench.engine(spec, regime=str(cfg.bench.memory.regime))
    engine.generate(bench.prompt(2), 1)
    with bench.memory.track() as figures:
        output = engine.generate(bench.prompt(length), int(cfg.bench.memory.new_tokens))
    return engine.policy.spec, {**figures, **bench.kv_bytes(engine, output.kv, length)}
