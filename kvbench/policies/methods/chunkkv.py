"""ChunkKV (Liu et al., 2025, arXiv 2502.00299): keep whole chunks of consecutive tokens, chosen by their mean score."""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.domains import choice, integer, setting
from kvbench.kernels.decode import counting
from kvbench.policies.base import COUNTINGS, Modifier
from kvbench.policies.context import ScoreContext
from kvbench.policies.registry import register


@register
@dataclass
class ChunkKV(Modifier):
    """The chosen slots are cut into chunks of ``chunk_length`` (the last one shorter); a chunk scores the mean over
    its slots of the base's score summed over the layer's cache heads (ChunkKV eq. 3), and the layer keeps the best
    ``max(1, int(chunks · kept / slots))`` whole chunks, one set for every head, as kvpress's ``ChunkKVPress``
    (chunkkv_press.py at 8bb29b9): a budget that is not whole chunks keeps fewer slots (or, where the last chunk is
    short, up to a chunk more); with no whole chunk, the base's own selection. ``counting``: ``selectable`` chunks the
    slots between the base's sinks and window (kept besides), ``kvpress`` every slot, the reserved ones scored above
    all (as kvpress's SnapKV pads its window's scores)."""

    name = "chunkkv"
    paper = "ChunkKV (arXiv 2502.00299)"
    transforms = True
    needs_attention = False
    reads_budget = True  # how many chunks: a share of the budget
    keeps_ranked_only = True  # the unchosen chunks rank -inf

    #: slots per chunk (ChunkKV's and kvpress's default)
    chunk_length: int = setting(integer(1, "a token count"), 20)
    counting: str = setting(choice(*COUNTINGS), "selectable")

    def transform(self, scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        tokens, length = scores.shape[-1], self.chunk_length
        if self.counting == "kvpress":  # every slot, the reserved above all (kvpress: scores.max() + 1)
            start, end, kept = 0, tokens, context.budget
        else:
            start, end, kept = context.sinks, tokens - context.recent, context.budget - context.sinks - context.recent
        span = end - start
        if span // length == 0 or kept <= 0:  # no whole chunk: the base's selection (kvpress: the press's compress)
            return self.base_selection(scores, context)
        key = self.name, length, self.counting, context.sinks, context.recent
        chunk_scores, slot_rank = context.of_score(key, lambda: self.chunks(scores, context, start, end))
        chunks = chunk_scores.shape[-1]
        count = max(1, int(chunks * (1 - (1 - kept / span))))  # kvpress: int(chunks * (1 - compression_ratio))
        chosen = chunk_scores.topk(count, dim=-1).indices  # [B,K]
        chunk_rank = torch.full_like(chunk_scores, -torch.inf).scatter(
            -1, chosen, descending_ranks(count, scores.device).expand_as(chosen)
        )  # [B,C]: the best chunk highest, the unchosen -inf
        ranking = (chunk_rank[..., None] * length + slot_rank).flatten(1)[:, :span]  # [B,S]
        full = F.pad(ranking, (start, tokens - end), value=torch.inf)  # [B,T]: reserved slots kept anyway
        return full[:, None].expand_as(scores)

    def chunks(
        self, scores: torch.Tensor, context: ScoreContext, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer's selection reads of ``scores [B,Hc,T]`` whatever the budget: each chunk's mean score
        ``[B,C]`` and each slot's rank within its chunk ``[B,C,L]``."""
        tokens, length, span = scores.shape[-1], self.chunk_length, end - start
        if self.counting == "kvpress":
            top = scores[..., context.sinks : tokens - context.recent].max() + 1
            slot = counting(tokens, scores.device)
            scores = scores.masked_fill((slot < context.sinks) | (slot >= tokens - context.recent), float(top))
        layer = scores[..., start:end].float().sum(dim=1)  # [B,S]: one selection per layer
        chunks = -(-span // length)
        padded = F.pad(layer, (0, chunks * length - span)).view(-1, chunks, length)  # [B,C,L]
        chunk_scores = padded.sum(dim=-1) / chunk_sizes(span, length, layer.device)  # [B,C]
        slot_rank = padded.nan_to_num(0.0, torch.inf, -torch.inf).argsort(dim=-1).argsort(dim=-1)  # [B,C,L]
        return chunk_scores, slot_rank

    @staticmethod
    def base_selection(scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        """The base's ranking with only its top ``budget`` (reserved slots kept besides) ranked, the rest -inf."""
        tokens = scores.shape[-1]
        middle = scores[..., context.sinks : tokens - context.recent]
        count = min(max(context.budget - context.sinks - context.recent, 0), middle.shape[-1])
        top = middle.topk(count, dim=-1).indices
        ranked = torch.full_like(middle, -torch.inf).scatter(-1, top, middle.gather(-1, top))
        return torch.cat([scores[..., : context.sinks], ranked, scores[..., tokens - context.recent :]], dim=-1)


@functools.lru_cache(maxsize=256)
def chunk_sizes(span: int, length: int, device: torch.device) -> torch.Tensor:
    """The slots of each chunk of ``span`` slots cut into chunks of ``length`` (the last one shorter) ``[C]``, made
    once per shape and device (read only)."""
    chunks = -(-span // length)
    return torch.tensor([length] * (chunks - 1) + [span - (chunks - 1) * length], device=device)


@functools.lru_cache(maxsize=256)
def descending_ranks(count: int, device: torch.device) -> torch.Tensor:
    """``count, count − 1, …, 1`` as float32 ``[count]``, made once per count and device (read only)."""
    return torch.arange(count, 0, -1, device=device, dtype=torch.float32)
