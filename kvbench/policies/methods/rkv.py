"""R-KV (Cai et al., 2025, arXiv 2505.24133): for reasoning traces, attention importance minus key redundancy."""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbench.domains import integer, number, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.registry import register


@register
@dataclass
class RKV(Policy):
    """Score ``λ·I_p − (1−λ)·R_p`` over the slots before the window, the ``window`` newest kept (R-KV §3, its
    ``R1KV.update_kv`` and ``cal_similarity`` at Zefan-Cai/R-KV d15c976). Importance ``I``: the window's queries'
    logits max-pooled over each KV group, softmaxed over the slots before the window, averaged over the queries,
    max-pooled over ``kernel`` slots. Redundancy ``R``: each key's cosine similarity to the cache's keys (itself 0),
    the last key more similar than ``threshold`` to each key (or the first slot, where none is) set to 0, averaged
    over the keys and softmaxed over the slots. Float32 throughout (R-KV rounds ``I`` to the model's dtype); the
    similarity is ``[T,T]`` a head, as R-KV's: meant for the short prompts and long traces of reasoning tasks."""

    name = "rkv"
    paper = "R-KV (arXiv 2505.24133)"
    swept: ClassVar[bool] = False  # the leaderboard's cells not run yet

    #: the observation window: its queries score, its tokens are kept (R-KV's ``window_size``)
    window: int = setting(integer(1, "a token count"), 8)
    kernel: int = setting(integer(1, "a kernel width"), 7)
    #: the importance's weight; the redundancy's is 1 − λ (``mix_lambda``)
    mix_lambda: float = setting(number(0.0, 1.0), 0.07)
    #: the cosine similarity above which a key counts as a repeat (``cal_similarity``'s ``threshold``)
    threshold: float = setting(number(-1.0, 1.0), 0.5)

    @property
    def statistic(self) -> Statistic:
        return "queries"

    def scoring_window(self, budget: int, prompt_len: int, decoding: bool = False) -> int:
        return self.window

    def reserved_recent(self, budget: int, prompt_len: int) -> int:
        return self.window

    def score(self, context: ScoreContext) -> torch.Tensor:
        assert context.window is not None  # the queries statistic
        keys = context.keys.float()  # [B,Hc,T,D]
        batch, heads, tokens, _ = keys.shape
        before = tokens - context.recent  # the slots the window does not keep
        if before <= 0:
            return context.positions.float()
        logits = context.window.logits.unflatten(1, (heads, -1)).amax(dim=2)  # [B,Hc,W,T]: max over the group
        importance = torch.softmax(logits[..., :before], dim=-1).mean(dim=2)  # [B,Hc,T']
        pad = self.kernel // 2
        importance = F.max_pool1d(importance.reshape(-1, 1, before), self.kernel, 1, pad).view(batch, heads, before)
        redundancy = self.redundancy(keys)[..., :before]
        prefix = self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
        window = prefix.new_full((batch, heads, context.recent), float("inf"))
        return torch.cat([prefix, window], dim=-1)

    def redundancy(self, keys: torch.Tensor) -> torch.Tensor:
        """``R [B,Hc,T]`` of the keys ``[B,Hc,T,D]`` (the class docstring)."""
        unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        similarity = unit @ unit.transpose(-1, -2)  # [B,Hc,T,T]
        similarity.diagonal(dim1=-2, dim2=-1).zero_()
        slots = torch.arange(keys.shape[2], device=keys.device)
        last = torch.where(similarity > self.threshold, slots, 0).amax(dim=-1, keepdim=True)  # [B,Hc,T,1]
        similarity.scatter_(-1, last, 0.0)
        return torch.softmax(similarity.mean(dim=-2), dim=-1)
