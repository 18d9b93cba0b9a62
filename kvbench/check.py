"""``kvbench check-method SPEC``: the invariants every policy holds, checked on one (a method of one's own named in
``KVBENCH_METHODS`` among them) on a tiny random model, so that its author checks it with one command from an
installed kvbench — the checks the registry's tests (tests/test_invariants.py, test_rows.py) run on every built-in
method:

* a budget covering the prompt runs the full cache (the same tokens as ``policy=full``);
* after the prefill every layer holds its budget at most, in tensors that really shrank (a policy that keeps whole
  layers or heads, ``bounded = False``: each its budget or the prompt);
* decoding after the eviction sees exactly the kept entries: its logits are a full forward's in which each head of
  each layer sees only the positions its cache kept, in the key channels it kept (:func:`masked_forward`, float32,
  1e-4);
* variants of one prompt prefilled together and decoded as rows of one batch give what each gives alone.

Each check prints one line, ``ok`` or what differs; the command exits 1 where one fails.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvbench.engine import Engine
from kvbench.engine.settings import REGIMES
from kvbench.engine.shared import generate_shared
from kvbench.errors import KVBenchError
from kvbench.policies import build_policy
from kvbench.policies.methods.full import Full

#: the checks' prompt and generation: long enough for a window, a chunk and sinks to leave heavy hitters
PROMPT, NEW_TOKENS, BUDGET, BLOCK = 96, 6, 40, 16


def masked_forward(
    model, tokens: list[int], kept: list[torch.Tensor], context: int, channels: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Logits ``[len(tokens) − context, V]`` of a full forward in which each token after the first ``context`` sees,
    in layer ``l`` and query head ``h``, only the context positions ``kept[l][h // G]`` (a mask ``[Hc, context]``)
    and the tokens after the context up to itself (within a layer's sliding window; with its learned sinks); with
    ``channels`` (a mask ``[Hc, D]`` per layer, ThinK's), the context keys only in those channels. The model attends
    through this function from then on (set another implementation to leave it)."""
    length = len(tokens)

    def attention(
        module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, s_aux=None, **_
    ):
        heads, group = query.shape[1], query.shape[1] // key.shape[1]
        allowed = torch.ones(heads, length, length, dtype=torch.bool).tril()
        if sliding_window is not None:  # transformers' band: the last ``sliding_window`` positions, itself included
            allowed &= torch.ones(length, length, dtype=torch.bool).triu(1 - sliding_window)
        allowed[:, context:, :context] &= kept[module.layer_idx].repeat_interleave(group, dim=0)[:, None]
        logits = torch.einsum("bhqd,bhtd->bhqt", query, key.repeat_interleave(group, 1)).float() * scaling
        if channels is not None:  # the later tokens read the context's keys in the channels kept, the rest zero
            narrowed = key[:, :, :context] * channels[module.layer_idx][None, :, None, :]  # [B,Hc,context,D]
            later = torch.einsum("bhqd,bhtd->bhqt", query[:, :, context:], narrowed.repeat_interleave(group, 1))
            logits[:, :, context:, :context] = later.float() * scaling
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        if s_aux is not None:  # GPT-OSS's learned sink: a logit per head in each denominator
            logits = torch.cat([logits, s_aux.float().view(1, heads, 1, 1).expand(1, heads, length, 1)], dim=-1)
        weights = logits.softmax(-1)[..., :length]
        return torch.einsum("bhqt,bhtd->bqhd", weights, value.repeat_interleave(group, 1)), None

    AttentionInterface.register("kvbench_check_masked", attention)
    AttentionMaskInterface.register("kvbench_check_masked", lambda *args, **kwargs: None)
    model.set_attn_implementation("kvbench_check_masked")
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, context:]


def kept_masks(cache, length: int) -> list[torch.Tensor]:
    """Each layer's kept positions in ``cache`` (row 0; a length per head or not) as masks ``[Hc, length]``."""
    return [
        torch.stack([torch.zeros(length, dtype=torch.bool).scatter_(0, torch.tensor(head), True) for head in heads])
        for heads in cache.kept_by_head()
    ]


def pruned_channels(cache) -> list[torch.Tensor] | None:
    """Each layer's kept key channels ``[Hc, D]`` (row 0; every channel of a layer it did not prune) where a modifier
    pruned them (ThinK), else None."""
    layers = cache.eviction_layers
    if all(layer.pruned is None for layer in layers):
        return None
    heads, dim = layers[0].values.shape[1], layers[0].values.shape[-1]
    masks = [torch.ones(heads, dim, dtype=torch.bool) for _ in layers]  # a sliding layer's keys whole
    for mask, layer in zip(masks, layers):
        if layer.pruned is not None:
            mask.zero_().scatter_(-1, layer.pruned.channels[0], True)
    return masks


def check_method(spec: str, model_name: str = "tiny_llama") -> list[tuple[str, str | None]]:
    """Each check of ``spec`` on ``model_name`` (a random one: its weights drawn from its seed): ``(what, None)`` where
    it holds, ``(what, what differs)`` where not. A setting or spec kvbench refuses is a one-line error."""
    from kvbench.models import load_model, model_config

    policy = build_policy(spec)  # an unknown name or setting: one line
    loaded = load_model(model_config(model_name))
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = torch.randint(3, len(tokenizer), (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()

    def engine(named: str, budget: int, regime: str = "oneshot") -> Engine:
        return Engine(model, build_policy(named), budget, regime, block_size=BLOCK, tokenizer=tokenizer)

    results: list[tuple[str, str | None]] = []
    regimes = [regime for regime in REGIMES if policy.refusal(regime, False) is None]
    if not regimes:
        raise KVBenchError(f"policy {spec} runs in no regime on a whole prompt: kvbench check-method checks those")
    for regime in regimes:
        covering = engine(spec, PROMPT, regime)
        full = engine("full", PROMPT, regime).generate(prompt, NEW_TOKENS).token_ids
        tokens = covering.generate(prompt, NEW_TOKENS).token_ids
        differs = (
            None if isinstance(covering.new_cache(PROMPT).policy, Full) and tokens == full else f"{tokens} != {full}"
        )
        results.append((f"{regime}: a budget covering the prompt runs the full cache", differs))
    runner = engine(spec, BUDGET)
    cache = runner.new_cache(PROMPT)
    token = int(runner.prefill(cache, prompt)[0, -1].argmax())
    held = [layer.keys.shape[2] for layer in cache.eviction_layers]
    over = [
        (index, length)
        for index, (length, budget) in enumerate(zip(cache.tokens_per_layer(), cache.layer_budgets))
        if length > budget
    ]
    if not runner.policy.bounded:  # SimLayerKV, DuoAttention: a layer or head keeps its budget or the whole prompt
        heads = [(index, int(count)) for index, mask in enumerate(kept_masks(cache, PROMPT)) for count in mask.sum(-1)]
        over = [(index, count) for index, count in heads if cache.layer_budgets[index] < count < PROMPT]
        held = [0]
    results.append(
        (
            "oneshot: every layer holds its budget at most (or the prompt, where a policy keeps it whole), its tensors "
            "shrunk",
            None if not over and max(held) < PROMPT else f"layers over their budgets: {over}, held {held}",
        )
    )
    kept = kept_masks(cache, PROMPT)
    step = runner.step(cache, [token], PROMPT, evict=False)[0, -1]
    channels = pruned_channels(cache)
    expected = masked_forward(model, prompt + [token], kept, PROMPT, channels)[-1]  # attends its own way from here
    error = float((step - expected).abs().max())
    attends = any(modifier.attends for modifier in runner.policy.modifiers)
    if attends:  # CaliDrop, SLAKE: decode attention recovers the evicted on purpose
        results.append(
            (
                "oneshot: decoding after the eviction sees exactly the kept entries",
                None if error > 1e-4 else "its attention adds nothing to the kept entries'",
            )
        )
    else:
        results.append(
            (
                "oneshot: decoding after the eviction sees exactly the kept entries",
                None if error <= 1e-4 else f"logits differ by {error:.2e}",
            )
        )
    engines = [engine(spec, budget) for budget in (BUDGET, BUDGET + 16)] + [engine("snapkv", BUDGET)]
    alone = [one.generate(prompt, NEW_TOKENS).token_ids for one in engines]
    together = [output.token_ids for output in generate_shared(engines, prompt, NEW_TOKENS)]
    results.append(
        (
            "oneshot: prefilled together and decoded as rows, each as alone",
            None if together == alone else f"{together} != {alone}",
        )
    )
    return results
