"""kvbench's SnapKV against kvpress's ``SnapKVPress`` configured identically (same window, kernel, averaging,
kept-token count): wall time and the Jaccard agreement of the kept token sets. It runs last in
``kvbench bench``: importing kvpress wraps every attention function registered in transformers.
"""

from __future__ import annotations

import importlib.metadata
import statistics
from typing import Any

import torch
import transformers

from kvbench.bench.measure import median_ratio, rotations, summary
from kvbench.bench.sections import Bench, native_attention
from kvbench.errors import KVBenchError


def compare(bench: Bench) -> dict[str, Any]:
    """kvbench's SnapKV against kvpress's ``SnapKVPress`` on one prompt, or ``{"skipped": reason}``."""
    try:
        import kvpress
    except ImportError as error:
        return {"skipped": f"kvpress is not importable ({error}); pip install 'kvbench[kvpress]'"}
    try:
        return snapkv_against_press(bench, kvpress)
    except (AssertionError, AttributeError, KeyError, RuntimeError, TypeError, ValueError) as error:
        # kvpress releases pin narrow transformers ranges; API drift surfaces as one of these
        version = importlib.metadata.version("kvpress")
        return {"skipped": f"kvpress {version} failed with transformers {transformers.__version__}: {error!r}"}


def snapkv_against_press(bench: Bench, kvpress) -> dict[str, Any]:
    """Both prefills interleaved over ``bench.repetitions``; times, the speed ratio and the kept-set agreement."""
    section = bench.bench.kvpress
    length, window, kernel = int(section.prompt_length), int(section.window), int(section.kernel)
    kept_tokens = bench.budget.resolve(length)
    if not window < kept_tokens < length:
        raise KVBenchError(f"kvpress comparison needs window {window} < kept tokens {kept_tokens} < prompt {length}")
    ids = bench.prompt(length)
    model, device = bench.loaded.model, bench.loaded.device
    # SnapKVPress: mean over the window and over each GQA group, avg pooling over the prefix, window kept
    engine = bench.engine("snapkv", window=window, kernel=kernel, pool="avg", gqa="mean")
    press = kvpress.SnapKVPress(compression_ratio=1.0 - kept_tokens / length, window_size=window, kernel_size=kernel)
    scores = recorded_scores(press)

    def run_kvbench():
        with torch.inference_mode():
            cache = engine.new_cache(length)
            engine.prefill(cache, ids)
        return cache

    def run_kvpress():
        return press_prefill(model, press, ids, bench.loaded.attn_backend)

    times: dict[str, list[float]] = {"kvbench": [], "kvpress": []}
    caches: dict[str, Any] = {}
    variants = {"kvbench": run_kvbench, "kvpress": run_kvpress}
    for repetition in range(bench.repetitions):
        for variant in rotations(list(variants), repetition):
            seconds, _, caches[variant] = bench.clock.measure(variants[variant])
            times[variant].append(seconds)
    jaccard = []
    for layer_idx, positions in enumerate(caches["kvbench"].kept_positions()):  # [B,Hkv,kept]
        press_kept = scores[layer_idx].topk(caches["kvpress"].layers[layer_idx].keys.shape[2], dim=-1).indices
        mine = torch.zeros(positions.shape[:-1] + (length,), dtype=torch.bool, device=device)
        mine.scatter_(-1, positions, True)
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
        "speed_ratio": median_ratio(raw["kvpress"], raw["kvbench"]),
        "jaccard_mean": statistics.fmean(per_layer),
        "jaccard_min": min(min(heads) for heads in jaccard),
        "jaccard_per_layer": per_layer,
    }


def recorded_scores(press) -> dict[int, torch.Tensor]:
    """Each layer's scores ``[B,Hkv,T]`` as ``press`` computes them, by layer index, from now on."""
    scores: dict[int, torch.Tensor] = {}
    score = press.score

    def recording_score(module, *args, **kwargs):
        scores[module.layer_idx] = result = score(module, *args, **kwargs)
        return result

    press.score = recording_score
    return scores


def press_prefill(model, press, ids: list[int], backend: str) -> transformers.DynamicCache:
    """The cache of one prefill of ``ids`` through ``press`` with transformers' own ``backend`` attention."""
    device = next(model.parameters()).device
    cache = transformers.DynamicCache(config=model.config)
    with native_attention(model, backend), torch.inference_mode(), press(model):
        # kvpress's hook reads cache_position, which transformers 5 no longer passes to attention
        model(
            input_ids=torch.tensor([ids], device=device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            cache_position=torch.arange(len(ids), device=device),
        )
    return cache
