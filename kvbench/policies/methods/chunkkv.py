"""ChunkKV (Liu et al., 2025, arXiv 2502.00299): keep chunks of consecutive tokens, chosen by their summed score."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.domains import integer, setting
from kvbench.policies.base import Modifier
from kvbench.policies.context import ScoreContext
from kvbench.policies.registry import register


@register
@dataclass
class ChunkKV(Modifier):
    """The cache is cut into chunks of ``chunk_length`` slots (the last one shorter); a chunk scores the mean over its
    slots of the base's score summed over the layer's cache heads (ChunkKV eq. 3, kvpress's ``ChunkKVPress``), and
    the layer keeps whole chunks in that order, one set for every head. A budget that is not whole chunks takes the
    best slots (by the base's score summed over heads) of the next chunk."""

    name = "chunkkv"
    paper = "ChunkKV (arXiv 2502.00299)"
    transforms = True
    needs_attention = False

    #: slots per chunk (ChunkKV's and kvpress's default)
    chunk_length: int = setting(integer(1, "a token count"), 20)

    def transform(self, scores: torch.Tensor, context: ScoreContext) -> torch.Tensor:
        layer = scores.float().sum(dim=1)  # [B,T]: one selection per layer
        tokens, length = layer.shape[-1], self.chunk_length
        chunks = -(-tokens // length)
        padded = F.pad(layer, (0, chunks * length - tokens)).view(-1, chunks, length)  # [B,C,L]
        sizes = torch.full((chunks,), length, device=layer.device)
        sizes[-1] = tokens - (chunks - 1) * length
        chunk_rank = (padded.sum(dim=-1) / sizes).argsort(dim=-1).argsort(dim=-1)  # [B,C]
        slot_rank = torch.where(padded == padded, padded, 0.0).argsort(dim=-1).argsort(dim=-1)  # [B,C,L]
        ranking = (chunk_rank[..., None] * length + slot_rank).flatten(1)[:, :tokens]  # a chunk above every later one
        return ranking.float()[:, None].expand_as(scores)
