"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV scores with budgets falling linearly over layers."""

from dataclasses import dataclass

from kvbench.policies.registry import register
from kvbench.policies.snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV's score (PyramidKV §3.3) with the pyramid layer budget (PyramidKV eq. 7, ``beta``)."""

    name = "pyramidkv"
    paper = "PyramidKV (arXiv 2406.02069)"

    layer_budget: str = "pyramid"
    beta: float = 20.0
