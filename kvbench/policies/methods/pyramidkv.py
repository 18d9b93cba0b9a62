"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV scores with budgets falling linearly over layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.domains import choice, number, setting
from kvbench.policies.layer_budget import LayerBudget, conserve_total
from kvbench.policies.methods.snapkv import SnapKV
from kvbench.policies.registry import register

PYRAMID_SCHEDULES = ("exact", "kvcache_factory")


@register
@dataclass
class Pyramid(LayerBudget):
    """PyramidKV eq. 7 on the non-reserved part ``b = budget − reserved`` (the window is kept in every layer):
    the bottom layer keeps ``2b − b/β``, the top ``b/β``, linear in between.

    ``schedule``: ``exact`` rounds eq. 7 so that the total is exactly ``b × L`` (largest remainders; a layer's share
    capped at the prompt, the rest shared by the others in eq. 7's proportions);
    ``kvcache_factory`` is the reference implementation the papers' PyramidKV rows ran (KVCache-Factory,
    ``pyramidkv/pyramidkv_utils.py`` ``PyramidKVCluster``): integer ``b // β`` and steps ``(max − min) // (L−1)``
    (so the total overshoots ``b × L``), the bottom layer clamped to the prompt, and every layer at the
    uniform budget when the prompt is shorter than ``2b``."""

    name = "pyramid"
    paper = "PyramidKV (arXiv 2406.02069)"

    beta: float = setting(number(0, low_open=True), 20.0)
    schedule: str = setting(choice(*PYRAMID_SCHEDULES), "exact")

    def allocate(self, budget: int, num_layers: int, reserved: int, prompt_len: int) -> list[int]:
        free = budget - reserved
        if num_layers == 1 or free <= 0:
            return [budget] * num_layers
        if self.schedule == "kvcache_factory":
            return [reserved + share for share in self._reference_shares(free, num_layers, prompt_len, reserved)]
        top = free / self.beta
        bottom = 2 * free - top
        raw = [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]  # PyramidKV eq. (7)
        caps = [prompt_len - reserved] * num_layers  # a layer holds the prompt at most: the rest goes to the others
        return [reserved + share for share in conserve_total(raw, free * num_layers, caps)]

    def _reference_shares(self, free: int, num_layers: int, prompt_len: int, reserved: int) -> list[int]:
        """KVCache-Factory's heavy-hitter counts per layer (the reserved window comes on top)."""
        if prompt_len < 2 * free:  # a short prompt: every layer at the uniform budget
            return [free] * num_layers
        smallest = int(free // self.beta)
        largest = 2 * free - smallest
        if largest >= prompt_len - reserved:
            largest = prompt_len - reserved
            smallest = 2 * free - largest
        steps = (largest - smallest) // (num_layers - 1)
        return [largest - layer * steps for layer in range(num_layers)]


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV's score (PyramidKV §3.3) with the pyramid layer budget (PyramidKV eq. 7)."""

    name = "pyramidkv"
    paper = "PyramidKV (arXiv 2406.02069)"

    layer_budget: LayerBudget = field(default_factory=Pyramid)
