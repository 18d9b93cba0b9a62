"""Random eviction (kvpress's ``RandomPress``): seeded random scores, the floor every results table needs."""

from dataclasses import dataclass

import torch

from kvbench.domains import SEED, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.registry import register


@register
@dataclass
class Random(Policy):
    """Score every cached slot by ``U(0, 1)`` drawn from a generator seeded with ``seed`` at each eviction, as
    kvpress's ``RandomPress(seed=...)`` (``torch.rand(B, Hkv, T)``; every layer draws the same scores); nothing
    reserved. The draw is one ``[Hc,T]`` on the CPU shared by the batch's rows, so a row keeps what it keeps alone
    and a GPU keeps what a CPU keeps."""

    name = "random"
    paper = "kvpress RandomPress"

    #: the generator's seed (kvpress's default ``None`` draws unseeded: a run could not be repeated)
    seed: int = setting(SEED, 0)

    @property
    def statistic(self) -> Statistic:
        return "entries"

    def score(self, context: ScoreContext) -> torch.Tensor:
        batch, heads, tokens = context.positions.shape
        generator = torch.Generator().manual_seed(self.seed)
        scores = torch.rand(heads, tokens, generator=generator)  # [Hc,T]
        return scores.to(context.positions.device).expand(batch, heads, tokens)
