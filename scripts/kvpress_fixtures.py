"""The kept sets of kvpress's presses on SmolLM2-135M-Instruct (float32, CPU): the reference of
``tests/test_kvpress_parity.py``, written to ``tests/fixtures/kvpress/<spec>.json``.

Run in kvpress's own environment (kvpress pins transformers < 5.3; docs/benchmarks.md shows how to make it):

    /tmp/kvp/bin/python scripts/kvpress_fixtures.py tests/fixtures/kvpress [SPEC ...]   # every spec by default
    /tmp/kvp/bin/python scripts/kvpress_fixtures.py tests/fixtures/kvpress/tiny_qwen3 --model tiny_qwen3

``--model NAME``: SnapKV's and KNorm's kept sets on another configured model (a tiny random one: its weights depend
only on its seed, the same in both environments, recorded as ``weights_sha256``), on the same essay prompts in its
tokenizer's ids.

Each prompt is ``LENGTH`` tokens of the Paul Graham essays (the RULER/NIAH haystack; kvbench's bench prompt, from
``OFFSETS`` characters in) prefilled once through the press with transformers' SDPA attention; the press keeps
``KEPT`` tokens per layer and KV head (``compression_ratio = 1 − KEPT / LENGTH``). Recorded: the prompt ids, and per
layer and KV head the kept positions as the press keeps them (the top-``KEPT`` of its own scores), as a bit mask of
the prompt's positions packed into bytes, base64-encoded. ``AdaKVPress`` is head-wise: it keeps ``KEPT`` per layer
and head on average, every entry in the cache, and masks the rest (``masked_key_indices``): recorded is what it does
not mask.

``simlayerkv*.json``, ``*+think*.json`` and ``duo_attention.json`` record what ``SimLayerKVPress`` keeps (it selects
no slot by score: each kept key found among an uncompressed prefill's), what ``ComposedPress([press, ThinKPress])``
keeps and the key channels it zeroes per head, and what ``DuoAttentionPress`` (on-the-fly scoring on kvbench's
calibration texts) does not mask, with its head scores.

``kvzip.json``: kvpress's ``KVzipPress`` is head-wise (one budget over every layer and head, kept by masking), so its
kept sets are not kvbench's per-layer ones; what the two define alike is the score and the layers' shares. Each
prompt is the chat template's user prefix and ``LENGTH`` tokens in all, reconstructed in chunks of ``KVZIP_CHUNK``
(three forwards); recorded: every layer's reconstruction scores ``[L,Hkv,T]`` (float32, base64) before the sinks are
raised (the first prompt's only, to keep the file small), the slots the press keeps per layer over its heads at
the same ``KEPT`` per layer and head on average, and each layer's kept mask per head (what it does not mask).
"""

from __future__ import annotations

import base64
import functools
import importlib.metadata
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

from kvbench.bench.kvpress import native_attention, press_prefill, recorded_scores
from kvbench.bench.sections import prompt_tokens
from kvbench.models import load_model, model_config, weights_digest
from kvbench.resources import paul_graham_essays

LENGTH, KEPT = 512, 128
KVZIP_CHUNK = 200
OFFSETS = (0, 40_000, 120_000)


def presses(kvpress) -> dict[str, object]:
    """kvbench spec → the kvpress press configured as kvbench's defaults (the kept count set below)."""
    ratio = 1.0 - KEPT / LENGTH
    return {
        "knorm": kvpress.KnormPress(compression_ratio=ratio),
        "keydiff": kvpress.KeyDiffPress(compression_ratio=ratio),
        # partitions of 32: the sinks and the last partition (64 slots) fill half the kept count, the ranked
        # partitions the rest (the default 128 would keep only the sinks and last partition of a 512-token prompt)
        "lagkv": kvpress.LagKVPress(compression_ratio=ratio, lag_size=32),
        "random": kvpress.RandomPress(compression_ratio=ratio, seed=0),
        "expected_attention": kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        "knorm+criticalkv": kvpress.CriticalKVPress(kvpress.KnormPress(compression_ratio=ratio)),
        # chunks of 16: 512 tokens are 32 whole chunks, 8 of them the kept count (the default 20 keeps 6 chunks,
        # 120 tokens, where kvbench keeps the budget's 128)
        "knorm+chunkkv": kvpress.ChunkKVPress(kvpress.KnormPress(compression_ratio=ratio), chunk_length=16),
        "snapkv+adakv": kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio)),
        "expected_attention+adakv": kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio)),
    }


#: fixtures at kvpress's default chunk length (20, which divides neither the prompt nor these kept counts: the prompt's
#: last chunk is partial) and over a base that reserves its window (SnapKV, kvpress's window 64): name → (kept,
#: the wrapping press, its scorer press)
COUNTING = {
    "knorm+chunkkv-k100": (100, "ChunkKVPress", "KnormPress"),
    "knorm+chunkkv-k200": (200, "ChunkKVPress", "KnormPress"),
    "snapkv+chunkkv-k200": (200, "ChunkKVPress", "SnapKVPress"),
    "snapkv+criticalkv-k200": (200, "CriticalKVPress", "SnapKVPress"),
}


#: SimLayerKV at a threshold that makes about half of SmolLM2's layers lazy on these prompts (0.8; kvbench's default 0.9
#: makes four): name → (kept, lazy_threshold); a lazy layer keeps ``n_initial`` (4) + ``n_recent − n_last`` slots,
#: kvbench's budget, so ``n_recent = kept − 4 + 1``
SIMLAYERKV = {
    "simlayerkv": (KEPT, 0.8),
    "simlayerkv-k200": (200, 0.8),
    "simlayerkv-k509": (509, 0.8),
    "simlayerkv-k510": (510, 0.8),
}


#: ThinK over a token press (kvpress's ``ComposedPress([scorer, ThinKPress])``): name → (the scorer press, the share of
#: key channels pruned); 0.3 of SmolLM2's 64 channels is 19.2, pruned 19
THINK = {
    "snapkv+think": ("SnapKVPress", 0.5),
    "knorm+think-p25": ("KnormPress", 0.25),
    "snapkv+think-p30": ("SnapKVPress", 0.3),
}


def think_record(model, press, ids: list[int]) -> dict:
    """``press`` (a token press, then ThinK) on ``ids``: per layer the kept positions (the top of the token press's
    scores) and each KV head's pruned key channels ``[Hkv, D]`` (those zero over every kept key), packed bit masks,
    base64."""
    scores = recorded_scores(press.presses[0])
    cache = press_prefill(model, press, ids, "sdpa")
    kept, pruned = [], []
    for layer_idx, layer in enumerate(cache.layers):
        top = scores[layer_idx][0].topk(layer.keys.shape[2], dim=-1).indices  # [Hkv,KEPT]
        mask = torch.zeros(top.shape[0], len(ids), dtype=torch.bool).scatter_(-1, top, True)
        kept.append(base64.b64encode(np.packbits(mask.numpy(), axis=-1).tobytes()).decode())
        zero = (layer.keys[0] == 0).all(dim=1)  # [Hkv,D]
        pruned.append(base64.b64encode(np.packbits(zero.numpy(), axis=-1).tobytes()).decode())
    return {"ids": ids, "kept_masks": kept, "pruned_channels": pruned}


#: DuoAttention's calibration texts in the fixture: kvpress's on-the-fly scoring draws 50, kvbench's default too;
#: 8 keep the test's calibration to seconds (the same loop, averaged over fewer texts)
DUO_SAMPLES = 8


def duo_record(model, kvpress, prompts: list[list[int]]) -> dict:
    """``DuoAttentionPress(head_compression_ratio=0.5, on_the_fly_scoring=True)`` calibrated on kvbench's first
    :data:`DUO_SAMPLES` calibration texts (the press's ``load_dataset`` answers them, in their order, for BookSum's
    chapters, and its ``num_samples`` is theirs): its head scores
    ``[L,Hkv]`` (float32, base64) and per prompt and layer what it does not mask (streaming heads keep their 128 first
    and 256 last slots)."""
    import pandas as pd

    from kvbench.policies.methods.duo_attention import DuoAttention

    class InOrder(pd.DataFrame):
        def sample(self, *args, **kwargs):  # the press draws its texts at random: here all of them, in order
            return self

    class Texts:
        def to_pandas(self):
            return InOrder({"chapter": DuoAttention(samples=DUO_SAMPLES).calibration_texts(paul_graham_essays())})

    module = sys.modules["kvpress.presses.duo_attention_press"]
    module.load_dataset = lambda *args, **kwargs: Texts()
    module.duo_attention_on_the_fly = functools.partial(module.duo_attention_on_the_fly, num_samples=DUO_SAMPLES)
    press = kvpress.DuoAttentionPress(head_compression_ratio=0.5, on_the_fly_scoring=True)
    scores = torch.from_numpy(module.duo_attention_on_the_fly(model)).float()
    records = []
    for ids in prompts:
        press_prefill(model, press, ids, "sdpa")
        records.append(
            {"ids": ids, "kept_masks": [masked_out(layer.self_attn, len(ids)) for layer in model.model.layers]}
        )
    return {
        "press": repr(press),
        "kept": press.sink_size + press.recent_size,
        "n_sink": press.sink_size,
        "samples": DUO_SAMPLES,
        "head_scores": base64.b64encode(scores.numpy().tobytes()).decode(),
        "prompts": records,
    }


#: kvpress's decoding compression (``PrefillDecodingPress``: the prompt to ``kept``, then every ``interval`` decoded
#: tokens back to it, ``DecodingPress(target_size=kept)``) over KNorm, greedy for ``steps`` tokens: name → (kept,
#: interval, steps). A key's norm is its own, so the prompt's compression keeps what one at the first interval would.
DECODING = {"knorm-decoding": (KEPT, 16, 40)}


def decoding_record(model, kvpress, ids: list[int], kept: int, interval: int, steps: int) -> dict:
    """The tokens generated greedily through the decoding press and each layer's kept positions of the prompt and
    those tokens at the end (a packed bit mask per KV head), tracked through every compression from the scores it
    kept by: the prompt's positions, then each compression's top ``kept`` of the cache in its order (the press
    gathers them in top-k order) and the tokens appended since."""
    prefilling = kvpress.KnormPress(compression_ratio=1.0 - kept / len(ids))
    decoding = kvpress.DecodingPress(base_press=kvpress.KnormPress(), compression_interval=interval, target_size=kept)
    press = kvpress.PrefillDecodingPress(prefilling_press=prefilling, decoding_press=decoding)
    scores: dict[int, list[torch.Tensor]] = {}
    for scorer in (prefilling, decoding.base_press):
        score = scorer.score

        def recording(module, *args, _score=score, **kwargs):
            result = _score(module, *args, **kwargs)
            scores.setdefault(module.layer_idx, []).append(result[0].clone())  # [Hkv,T]
            return result

        scorer.score = recording
    cache, tokens = transformers.DynamicCache(config=model.config), []
    with native_attention(model, "sdpa"), torch.inference_mode(), press(model):
        positions = torch.arange(len(ids))
        logits = model(
            input_ids=torch.tensor([ids]), past_key_values=cache, cache_position=positions, logits_to_keep=1
        ).logits
        for step in range(steps):
            tokens.append(int(logits[0, -1].argmax()))
            at = torch.tensor([len(ids) + step])
            logits = model(
                input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, cache_position=at, position_ids=at[None]
            ).logits
    length, masks = len(ids) + steps, []
    for layer_idx in range(len(cache.layers)):
        held = torch.arange(len(ids)).expand(scores[layer_idx][0].shape[0], -1)  # [Hkv,T] in the cache's order
        for number, layer_scores in enumerate(scores[layer_idx]):
            if number:  # a decoding compression: the tokens appended since the last
                appended = torch.arange(len(ids) + (number - 1) * interval, len(ids) + number * interval)
                held = torch.cat([held, appended.expand(held.shape[0], -1)], dim=-1)
            held = held.gather(-1, layer_scores.topk(kept, dim=-1).indices)
        done = len(ids) + (len(scores[layer_idx]) - 1) * interval
        held = torch.cat([held, torch.arange(done, length).expand(held.shape[0], -1)], dim=-1)
        assert held.shape[-1] == cache.layers[layer_idx].keys.shape[2]
        mask = torch.zeros(held.shape[0], length, dtype=torch.bool).scatter_(-1, held, True)
        masks.append(base64.b64encode(np.packbits(mask.numpy(), axis=-1).tobytes()).decode())
    return {"ids": ids, "generated": tokens, "kept_masks": masks}


def kept_masks(model, press, ids: list[int]) -> list[str]:
    """Per layer: the press's kept positions ``[Hkv, LENGTH]`` as a packed bit mask, base64: the top of its recorded
    scores (a scorer press), or else each kept key's position among the keys of an uncompressed prefill (ChunkKV,
    which selects chunks; the prefill's forward is the same, so its keys are bit for bit the kept ones)."""
    scores = recorded_scores(press) if hasattr(press, "score") else None
    cache = press_prefill(model, press, ids, "sdpa")
    if isinstance(press, kvpress_module().AdaKVPress):  # head-wise: it masks what it evicts, the cache keeps its length
        return [masked_out(layer.self_attn, len(ids)) for layer in model.model.layers]
    if scores is None:
        full = press_prefill(model, kvpress_module().KnormPress(compression_ratio=0.0), ids, "sdpa")
    masks = []
    for layer_idx, layer in enumerate(cache.layers):
        if scores is not None:
            kept = scores[layer_idx][0].topk(layer.keys.shape[2], dim=-1).indices  # [Hkv,KEPT]
        else:
            same = (layer.keys[0][:, :, None] == full.layers[layer_idx].keys[0][:, None]).all(-1)  # [Hkv,KEPT,T]
            assert (same.sum(-1) == 1).all()
            kept = same.float().argmax(-1)
        mask = torch.zeros(kept.shape[0], len(ids), dtype=torch.bool).scatter_(-1, kept, True)
        masks.append(base64.b64encode(np.packbits(mask.numpy(), axis=-1).tobytes()).decode())
    return masks


def masked_out(attention, length: int) -> str:
    """A head-wise press's kept positions of one layer (all but the ``masked_key_indices`` it set on the attention
    module, batch 0) as a packed bit mask, base64."""
    _, heads, slots = attention.masked_key_indices
    del attention.masked_key_indices
    mask = torch.ones(attention.config.num_key_value_heads, length, dtype=torch.bool)
    mask[heads, slots] = False
    return base64.b64encode(np.packbits(mask.numpy(), axis=-1).tobytes()).decode()


def kvzip_record(model, tokenizer, kvpress, text_ids: list[int], scores: bool) -> dict:
    """KVzipPress's per-layer kept counts for the user prefix + ``text_ids`` (``LENGTH`` tokens in all), and with
    ``scores`` its scores."""
    press = kvpress.KVzipPress(compression_ratio=1.0 - KEPT / LENGTH, chunk_size=KVZIP_CHUNK)
    recorded: dict = {}
    compress = press.compress_post

    def recording(model):
        recorded["scores"] = press.score_val[:, 0].float().clone()  # [L,Hkv,T], before the sinks are raised
        recorded["prefix"] = press.prefix_length
        compress(model)
        for layer in model.model.layers:
            recorded.setdefault("pruned", []).append(int(layer.self_attn.masked_key_indices[0].numel()))
            recorded.setdefault("masks", []).append(masked_out(layer.self_attn, len(ids)))

    press.compress_post = recording
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "dummy context"}], tokenize=False, enable_thinking=False
    ).split("dummy context")[0]
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
    ids = prefix_ids + text_ids[: LENGTH - len(prefix_ids)]
    press_prefill(model, press, ids, "sdpa")
    assert recorded["prefix"] == len(prefix_ids)
    heads = recorded["scores"].shape[1]
    record = {"ids": ids, "prefix": recorded["prefix"]}
    if scores:
        record["scores"] = base64.b64encode(recorded["scores"].numpy().tobytes()).decode()
    kept_per_layer = [heads * LENGTH - pruned for pruned in recorded["pruned"]]
    return {**record, "kept_per_layer": kept_per_layer, "kept_masks": recorded["masks"]}


def other_model(output: Path, name: str) -> None:
    """SnapKV's and KNorm's kept sets on model ``name`` (see the module's docstring)."""
    kvpress = kvpress_module()
    loaded = load_model(model_config(name))
    text = paul_graham_essays()
    prompts = [prompt_tokens(loaded.tokenizer, text[offset:], LENGTH) for offset in OFFSETS]
    output.mkdir(parents=True, exist_ok=True)
    ratio = 1.0 - KEPT / LENGTH
    for spec, press in {
        "snapkv": kvpress.SnapKVPress(compression_ratio=ratio),
        "knorm": kvpress.KnormPress(compression_ratio=ratio),
    }.items():
        record = {
            "made_by": "scripts/kvpress_fixtures.py --model",
            "kvpress": importlib.metadata.version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "model": name,
            "weights_sha256": weights_digest(loaded.model),
            "length": LENGTH,
            "kept": KEPT,
            "press": repr(press),
            "prompts": [{"ids": ids, "kept_masks": kept_masks(loaded.model, press, ids)} for ids in prompts],
        }
        (output / f"{spec}.json").write_text(json.dumps(record) + "\n")
        print(f"wrote {output / f'{spec}.json'}")


def kvpress_module():
    import kvpress

    return kvpress


def main(output: Path, only: list[str]) -> None:
    kvpress = kvpress_module()
    loaded = load_model(model_config("smollm2_135m"))
    text = paul_graham_essays()
    prompts = [prompt_tokens(loaded.tokenizer, text[offset:], LENGTH) for offset in OFFSETS]
    output.mkdir(parents=True, exist_ok=True)
    provenance = {
        "made_by": "scripts/kvpress_fixtures.py",
        "kvpress": importlib.metadata.version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": loaded.model.config.name_or_path,
        "length": LENGTH,
        "kept": KEPT,
    }

    def write(spec: str, record: dict) -> None:
        (output / f"{spec}.json").write_text(json.dumps({**provenance, **record}) + "\n")
        print(f"wrote {output / f'{spec}.json'}")

    for spec, press in presses(kvpress).items():
        if not only or spec in only:
            masks = [{"ids": ids, "kept_masks": kept_masks(loaded.model, press, ids)} for ids in prompts]
            write(spec, {"press": repr(press), "prompts": masks})
    for spec, (kept, wrapper, scorer) in COUNTING.items():
        if not only or spec in only:
            press = getattr(kvpress, wrapper)(getattr(kvpress, scorer)(compression_ratio=1.0 - kept / LENGTH))
            masks = [{"ids": ids, "kept_masks": kept_masks(loaded.model, press, ids)} for ids in prompts]
            write(spec, {"press": repr(press), "kept": kept, "prompts": masks})
    for spec, (kept, threshold) in SIMLAYERKV.items():
        if not only or spec in only:
            press = kvpress.SimLayerKVPress(lazy_threshold=threshold, n_recent=kept - 4 + 1)
            masks = [{"ids": ids, "kept_masks": kept_masks(loaded.model, press, ids)} for ids in prompts]
            write(spec, {"press": repr(press), "kept": kept, "prompts": masks})
    for spec, (scorer, share) in THINK.items():
        if not only or spec in only:
            token_press = getattr(kvpress, scorer)(compression_ratio=1.0 - KEPT / LENGTH)
            press = kvpress.ComposedPress([token_press, kvpress.ThinKPress(key_channel_compression_ratio=share)])
            records = [think_record(loaded.model, press, ids) for ids in prompts]
            write(spec, {"press": repr(press), "pruned": share, "prompts": records})
    for spec, (kept, interval, steps) in DECODING.items():
        if not only or spec in only:
            records = [decoding_record(loaded.model, kvpress, ids, kept, interval, steps) for ids in prompts]
            write(spec, {"kept": kept, "interval": interval, "steps": steps, "prompts": records})
    if not only or "duo_attention" in only:
        write("duo_attention", duo_record(loaded.model, kvpress, prompts))
    if not only or "kvzip" in only:
        press = f"KVzipPress(compression_ratio={1.0 - KEPT / LENGTH}, chunk_size={KVZIP_CHUNK})"
        records = [
            kvzip_record(loaded.model, loaded.tokenizer, kvpress, ids, number == 0)
            for number, ids in enumerate(prompts)
        ]
        write("kvzip", {"press": press, "chunk_size": KVZIP_CHUNK, "prompts": records})


if __name__ == "__main__":
    if "--model" in sys.argv:
        other_model(Path(sys.argv[1]), sys.argv[sys.argv.index("--model") + 1])
    else:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/kvpress"), sys.argv[2:])
