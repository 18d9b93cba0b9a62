"""Expected Attention (Devoto et al., 2025, arXiv 2510.00636): the attention the queries to come are expected to
pay each cached key, in closed form from the statistics of the queries seen, times the value's norm."""

import math
from dataclasses import dataclass

import torch

from kvbench.domains import FLAG, integer, number, setting
from kvbench.errors import KVBenchError
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.registry import register


def unrotated(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Queries ``[B,H,W,D]`` before RoPE from after: ``R(p)⁻¹ = (cos·I − sin·P) / (cos² + sin²)`` with ``P`` the
    ``rotate_half`` matrix (the denominator is 1 but for a scaled RoPE's attention factor)."""
    half = queries.shape[-1] // 2
    turned = torch.cat([queries[..., half:], -queries[..., :half]], dim=-1)  # P⁻¹·q = −rotate_half(q)
    return (queries * cos + turned * sin) / (cos * cos + sin * sin)


def averaged_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R̄ = mean_n (cos_n·I + sin_n·P) [D,D]`` over the future positions' ``cos``/``sin [N,D]`` (EA eq. 9)."""
    dim = cos.shape[-1]
    eye = torch.eye(dim, dtype=cos.dtype, device=cos.device)
    half = eye[: dim // 2, : dim // 2]
    turn = torch.zeros_like(eye)
    turn[dim // 2 :, : dim // 2], turn[: dim // 2, dim // 2 :] = half, -half
    return (cos[:, None, :] * eye + sin[:, None, :] * turn).mean(dim=0)


#: keys per block of the covariance term: its ``Σ̄k`` is ``[B,Hc,G,block,D]`` float32 (at 32k keys on Llama-3.1-8B's
#: shapes, 537 MB a layer unblocked; 67 MB in blocks of 4096)
SPREAD_KEYS = 4096


def quadratic_form(covariance: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``kᵀΣ̄k [B,Hc,G,T]`` of each key ``[B,Hc,T,D]`` under each query head's ``covariance [B,Hc,G,D,D]``."""
    turned = torch.einsum("bcgde,bcte->bcgtd", covariance, keys)  # Σ̄k
    return (turned * keys[:, :, None]).sum(dim=-1)


@register
@dataclass
class ExpectedAttention(Policy):
    """The queries seen (every query of the prompt after the ``n_sink`` first, before RoPE) give a mean ``μ`` and
    covariance ``Σ`` per query head; rotated by RoPE averaged over the next ``n_future_positions`` positions
    (``μ̄ = R̄μ``, ``Σ̄ = R̄ΣR̄ᵀ``), a key's expected logit is ``μ̄·k/√d + ½ kᵀΣ̄k/d`` (EA eq. 6, the Gaussian's
    moment-generating function), softmaxed over the cache, averaged over each KV group and times ``‖v‖₂``; the
    ``n_sink`` first slots are kept. As kvpress's ``ExpectedAttentionPress``. In the chunked and streaming regimes
    the statistics are those of every query seen so far (the last ``prompt length`` of them while decoding)."""

    name = "expected_attention"
    paper = "Expected Attention (arXiv 2510.00636)"

    #: future positions RoPE is averaged over (kvpress's default)
    n_future_positions: int = setting(integer(1, "a token count"), 512)
    #: first slots kept, and first queries left out of the statistics (their outliers)
    n_sink: int = setting(integer(0, "a token count"), 4)
    #: the covariance term (False: the mean alone)
    use_covariance: bool = setting(FLAG, True)
    #: times the value's norm
    use_vnorm: bool = setting(FLAG, True)
    #: added to the expected attention before the value norm
    epsilon: float = setting(number(0.0), 0.0)

    @property
    def statistic(self) -> Statistic:
        return "queries"

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return prompt_len

    def reserved_sinks(self) -> int:
        return self.n_sink

    def score(self, context: ScoreContext) -> torch.Tensor:
        stats, weights = context.window, context.weights
        if stats is None or weights is None or weights.rotary is None:
            raise KVBenchError(f"policy {self.name} needs the model's rotary embedding (a Llama-style rotary_emb)")
        cos, sin = weights.rotation(stats.query_positions)  # [W,D]
        queries = unrotated(stats.queries.float(), cos, sin)  # [B,Hq,W,D]
        if context.next_position is None:
            queries = queries[:, :, stats.query_positions >= self.n_sink]  # [B,Hq,W',D]
        else:  # the window's positions run up to the host's count: the first n_sink cut by a slice, not a mask
            first = context.next_position - queries.shape[2]  # (a mask's shape is read back: a GPU synchronises)
            queries = queries[:, :, min(max(self.n_sink - first, 0), queries.shape[2]) :]  # [B,Hq,W',D]
        mean = queries.mean(dim=2)  # [B,Hq,D]
        following = int(context.positions.max()) + 1 if context.next_position is None else context.next_position
        count, device = self.n_future_positions, mean.device

        def rotation_ahead() -> torch.Tensor:  # the positions made on the device (a copy from the host synchronises)
            return averaged_rotation(*weights.rotation(torch.arange(following, following + count, device=device)))

        rotation = context.once(("rotation", following, count), rotation_ahead)  # once for a shared prefill's variants
        mean = mean @ rotation.T
        keys, values = context.keys.float()[:, :, self.n_sink :], context.values.float()[:, :, self.n_sink :]
        batch, heads, tokens, dim = keys.shape  # [B,Hc,T',D]
        group = mean.shape[1] // heads
        logits = torch.einsum("bcgd,bctd->bcgt", mean.view(batch, heads, group, dim), keys) / math.sqrt(dim)
        if self.use_covariance:
            centred = queries - queries.mean(dim=2, keepdim=True)
            covariance = torch.einsum("bhwi,bhwj->bhij", centred, centred) / queries.shape[2]  # [B,Hq,D,D]
            covariance = rotation @ covariance @ rotation.T
            grouped = covariance.view(batch, heads, group, dim, dim)
            spread = torch.cat([quadratic_form(grouped, part) for part in keys.split(SPREAD_KEYS, dim=2)], dim=-1)
            logits = logits + spread / dim / 2
        scores = torch.softmax(logits, dim=-1).mean(dim=2)  # [B,Hc,T']
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        sinks = scores.amax(dim=-1, keepdim=True).add(1).expand(-1, -1, min(self.n_sink, context.keys.shape[2]))
        return torch.cat([sinks, scores], dim=-1)  # the sinks above every slot, as kvpress pads them
