"""How a row chooses its next token: greedily (the default), or drawn from the softmax of its logits at
``temperature`` within the ``top_p`` nucleus (Hugging Face's ``TemperatureLogitsWarper`` then ``TopPLogitsWarper``),
each row from its own generator seeded once (``Row.seed``), so a row draws the same tokens alone or beside others."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """``generation.temperature`` (> 0), ``generation.top_p`` (in (0, 1]) and ``generation.seed`` of a run that
    samples: each sample's rows draw from :func:`draw_seed` of the seed and the sample's id."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def draw(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """One token from ``logits [V]`` (float32): the smallest set of the most likely tokens whose probability
        reaches ``top_p`` (the most likely always in it), renormalised."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(dim=-1) - ordered >= self.top_p  # [V]: the mass before a token already reaches top_p
        ordered = ordered.masked_fill(outside, 0.0)
        pick = torch.multinomial(ordered.cpu(), 1, generator=generator)
        return int(order[pick.to(order.device)])


def draw_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the draws of ``name`` (a sample's id) under the run's ``seed``: the same on every machine."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big") >> 1


def seeded(seed: int) -> torch.Generator:
    """A CPU generator at ``seed`` (draws on the host: the same tokens whatever device the logits are on)."""
    return torch.Generator().manual_seed(seed)
