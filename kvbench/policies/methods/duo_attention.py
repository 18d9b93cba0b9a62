"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819): retrieval heads keep the whole context, streaming heads
their first and most recent tokens; the heads told apart once per model (kvpress's calibration-free on-the-fly form)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.domains import integer, number, setting
from kvbench.errors import KVBenchError
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic, evicting_again
from kvbench.policies.registry import register

#: each model's head scores ``[L,Hkv]`` by its calibration settings, while the model lives
HEAD_SCORES: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, torch.Tensor]] = weakref.WeakKeyDictionary()


@register
@dataclass
class DuoAttention(Policy):
    """The ``streaming`` share of a model's KV heads (``round(L·Hkv·streaming)``, the lowest head scores over every
    layer) keep their first ``n_sink`` tokens and most recent ``budget − n_sink``; the other heads (retrieval heads)
    keep every token, so each head holds its own length (as AdaKV) and the cache between the budget and the prompt.

    The head scores are kvpress's calibration-free stand-in for DuoAttention's optimised gates
    (``DuoAttentionPress(on_the_fly_scoring=True)``, ``duo_attention_on_the_fly``): over ``samples`` calibration texts,
    each layer's mean query and mean key (of the text's hidden states, through the layer's norm and projections) are
    repeated ``query_length`` times and rotated by RoPE; a head scores the area under the cumulated attention of the
    last such query, averaged over its KV group and the texts. kvpress takes 50 BookSum chapters; kvbench the first
    ``samples`` pieces of ``sample_chars`` characters of the Paul Graham essays (about 480 tokens each in SmolLM2's
    tokenizer, as many as kvpress's queries; offline: the engine hands them over,
    :meth:`calibrate`), and applies a Qwen 3 / Gemma 3 layer's query and key norms, which kvpress means to but skips.
    kvpress's on-the-fly sink and window are 128 and 256: ``n_sink`` 128 at ``budget=384``."""

    name = "duo_attention"
    paper = "DuoAttention (arXiv 2410.10819)"
    swept = False  # the leaderboard's cells not run yet
    bounded = False  # a retrieval head keeps the prompt

    #: the share of the KV heads that stream (kvpress's ``head_compression_ratio``)
    streaming: float = setting(number(0, 1), 0.5)
    n_sink: int = setting(integer(0, "a token count"), 128)
    samples: int = setting(integer(1, "a text count"), 50)
    query_length: int = setting(integer(1, "a token count"), 500)
    sample_chars: int = setting(integer(1, "a character count"), 2000)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.streaming_heads: torch.Tensor | None = None  # [L,Hkv] True = streaming, set by calibrate

    @property
    def statistic(self) -> Statistic:
        return "positions"

    def reserved_sinks(self) -> int:
        return self.n_sink

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        return max(budget - self.n_sink, 0)

    @property
    def shares_heads(self) -> bool:
        return True  # a retrieval head keeps everything, a streaming head its sinks and window

    def head_shares(self, scores: torch.Tensor, budget: int, reserved: int) -> torch.Tensor:
        return torch.isfinite(scores).sum(dim=-1)  # [B,Hc]: a retrieval head every middle slot, a streaming one none

    def refusal(self, regime: str, query_agnostic: bool, decode_evict: bool = False) -> str | None:
        if (how := evicting_again(regime, decode_evict)) is not None:
            return f"policy {self.spec} evicts once, after the prompt, to a length per head: {how} evicts again"
        if self.modifiers:
            return (
                f"policy {self.spec}: duo_attention keeps whole heads or their windows, ranking no slot; use it alone"
            )
        return None

    def score(self, context: ScoreContext) -> torch.Tensor:
        """``-inf`` on every slot of a streaming head (its sinks and window kept besides), 0 on a retrieval head's."""
        if self.streaming_heads is None:
            raise KVBenchError(f"policy {self.spec} is not calibrated: the engine calibrates it on the model first")
        streaming = self.streaming_heads[context.layer].to(context.positions.device)  # [Hkv]
        streaming = streaming.repeat_interleave(context.positions.shape[1] // streaming.shape[0])  # [Hc]
        ranking = torch.zeros(context.positions.shape, device=context.positions.device)
        return ranking.masked_fill(streaming[None, :, None], -torch.inf)

    # -- calibration ---------------------------------------------------------------------------------------
    def calibration_texts(self, text: str) -> list[str]:
        """The first ``samples`` pieces of ``sample_chars`` characters of ``text``."""
        pieces = [text[start : start + self.sample_chars] for start in range(0, len(text), self.sample_chars)]
        if len(pieces) < self.samples:
            raise KVBenchError(f"policy.samples={self.samples}: the calibration text has {len(pieces)} pieces")
        return pieces[: self.samples]

    def streaming_count(self, model: Any) -> tuple[int, tuple[int, int]]:
        """How many KV heads stream, ``round(L·Hkv·streaming)``, and ``(L, Hkv)``."""
        config = model.config.get_text_config()
        shape = (config.num_hidden_layers, config.num_key_value_heads)
        return round(shape[0] * shape[1] * self.streaming), shape

    def calibration_refusal(self, model: Any) -> str | None:
        """The head scores read each layer's ``q_proj`` and ``k_proj``: a model whose attention fuses them (Phi-3's
        ``qkv_proj``) is refused, unless no head or every head streams (nothing is scored)."""
        count, shape = self.streaming_count(model)
        if count in (0, shape[0] * shape[1]) or all(
            hasattr(layer.self_attn, "q_proj") and hasattr(layer.self_attn, "k_proj") for layer in model.model.layers
        ):
            return None
        return (
            f"policy {self.spec} scores its heads from each layer's q_proj and k_proj, which this model's attention "
            f"fuses (qkv_proj); valid choices here: policy.streaming=0 or 1 (nothing scored), or another policy"
        )

    def calibrate(self, model: Any, tokenizer: Any, text: str) -> None:
        """Set the streaming heads of ``model`` from its head scores on :meth:`calibration_texts` of ``text``: the
        ``round(L·Hkv·streaming)`` lowest over every layer (none, or all, without scoring where that is 0 or all)."""
        count, shape = self.streaming_count(model)
        if count in (0, shape[0] * shape[1]):
            self.streaming_heads = torch.full(shape, bool(count))
            return
        key = (self.samples, self.query_length, self.sample_chars, text[:64])
        scores = HEAD_SCORES.setdefault(model, {})
        if key not in scores:
            scores[key] = head_scores(model, tokenizer, self.calibration_texts(text), self.query_length)
        lowest = scores[key].flatten().argsort()[:count]
        self.streaming_heads = torch.zeros(shape, dtype=torch.bool).flatten().index_fill_(0, lowest, True).view(shape)


def mean_repeated(states: torch.Tensor, attention: Any, part: str, length: int) -> torch.Tensor:
    """The mean over the tokens of ``states [1,T,hidden]`` projected to ``attention``'s query or key heads (``part``
    ``q`` or ``k``; normed, where the layer norms them), repeated ``length`` times: ``[1,H,length,D]``."""
    heads = getattr(attention, f"{part}_proj")(states).view(1, states.shape[1], -1, attention.head_dim)
    norm = getattr(attention, f"{part}_norm", None)
    heads = heads if norm is None else norm(heads)
    return heads.mean(dim=1, keepdim=True).repeat(1, length, 1, 1).transpose(1, 2)


@torch.inference_mode()
def head_scores(model: Any, tokenizer: Any, texts: list[str], query_length: int) -> torch.Tensor:
    """``[L,Hkv]`` float32: per layer and KV head, over ``texts``, the mean of the area under the cumulated attention
    of the last of ``query_length`` copies of the layer's mean query over as many copies of its mean key, both rotated
    to their positions (kvpress's ``duo_attention_on_the_fly``)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # where a model runs (a 3 s import)

    config = model.config.get_text_config()
    layers = model.model.layers
    if not all(hasattr(layer.self_attn, "q_proj") and hasattr(layer.self_attn, "k_proj") for layer in layers):
        raise KVBenchError("policy duo_attention scores heads from q_proj/k_proj: this model's attention has none")
    group = config.num_attention_heads // config.num_key_value_heads
    scores = torch.zeros(len(layers), config.num_key_value_heads)
    device = next(model.parameters()).device
    positions = torch.arange(query_length, device=device)[None]
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").to(device)
        hidden = model(**ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states[:-1]
        for index, (states, layer) in enumerate(zip(hidden, layers)):
            attention, states = layer.self_attn, layer.input_layernorm(states)
            query, key = (mean_repeated(states, attention, part, query_length) for part in ("q", "k"))
            dim = attention.head_dim
            cos, sin = model.model.rotary_emb(states, positions)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            key = key.repeat_interleave(group, dim=1)
            weights = (torch.matmul(query[:, :, -1:], key.transpose(2, 3)) / dim**0.5).softmax(-1, dtype=torch.float32)
            area = weights.squeeze().cumsum(dim=1).mean(dim=1)  # [Hq]
            scores[index] += area.view(-1, group).mean(dim=1).cpu() / len(texts)
    return scores
