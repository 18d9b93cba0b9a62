"""Budgets: parsing ``budget=`` specs and allocating a total budget across layers.

Static allocations (``uniform``, ``pyramid``) are fixed before the prompt is seen. Dynamic ones (``cake``,
``vabs``) score each layer's preference from its observation-window attention during prefill and share
the total in CAKE's cascading manner (:class:`CascadingAllocation`); the cache drives them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from kvbench.errors import KVBenchError, choose

_BUDGET = re.compile(r"^(?P<number>\d+(\.\d+)?)(?P<unit>k|pct)?$")


@dataclass(frozen=True)
class Budget:
    """A per-layer KV budget: a token count (``2048``, ``2k``) or a fraction of the prompt (``10pct``)."""

    spec: str
    tokens: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, spec) -> Budget:
        text = str(spec).strip().lower()
        match = _BUDGET.match(text)
        if match is None:
            raise KVBenchError(
                f"invalid budget {spec!r}; use a positive token count (64, 2048, 2k) or a prompt fraction (10pct)"
            )
        number, unit = float(match["number"]), match["unit"]
        if number <= 0:
            raise KVBenchError(f"invalid budget {spec!r}: it must be > 0")
        if unit == "pct":
            if number > 100:
                raise KVBenchError(f"invalid budget {spec!r}: a fraction of the prompt must be at most 100pct")
            return cls(text, fraction=number / 100.0)
        tokens = number * 1024 if unit == "k" else number
        if tokens != int(tokens):
            raise KVBenchError(f"invalid budget {spec!r}: a token count must be a whole number")
        return cls(text, tokens=int(tokens))

    def resolve(self, prompt_len: int) -> int:
        """Tokens per layer for a prompt of ``prompt_len`` tokens (at least 1)."""
        if self.tokens is not None:
            return self.tokens
        return max(1, round(self.fraction * prompt_len))


LAYER_BUDGETS = ["uniform", "pyramid", "cake", "vabs"]
DYNAMIC_LAYER_BUDGETS = ("cake", "vabs")


def layer_budgets(kind: str, budget: int, num_layers: int, *, beta: float = 20.0, reserved: int = 0) -> list[int]:
    """Split ``budget × num_layers`` tokens over layers; the total is conserved exactly.

    ``uniform``: every layer gets ``budget``. ``pyramid``: PyramidKV eq. 7 on the non-reserved part
    ``b = budget − reserved`` (the observation window is kept in every layer): the top layer keeps
    ``b / beta``, the bottom ``2b − b / beta``, linear in between. ``cake`` / ``vabs`` start uniform; the
    cache re-allocates them during prefill (:class:`CascadingAllocation`).
    """
    choose("policy.layer_budget", kind, LAYER_BUDGETS)
    free = budget - reserved
    if kind != "pyramid" or num_layers == 1 or free <= 0:
        return [budget] * num_layers
    top = free / beta
    bottom = 2 * free - top
    raw = [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]
    return [reserved + share for share in conserve_total(raw, free * num_layers)]


def conserve_total(raw: list[float], total: int, caps: list[int] | None = None) -> list[int]:
    """Round shares ``∝ raw`` (non-negative; all zero = equal) to integers summing to ``total`` (largest
    remainders first). With ``caps`` no share exceeds its cap: capped shares are fixed and the rest of the
    total is shared again in proportion (water-filling); if the caps hold less than ``total``, all are full."""
    caps = [math.inf] * len(raw) if caps is None else caps
    if total >= sum(caps):
        return list(caps)
    weights = list(raw) if sum(raw) > 0 else [1.0] * len(raw)
    exact, open_, left = [0.0] * len(raw), set(range(len(raw))), float(total)
    while open_:
        weight = sum(weights[index] for index in open_)
        if weight == 0:  # only zero-preference shares remain open: they split the rest equally
            weights = [1.0 if index in open_ else value for index, value in enumerate(weights)]
            continue
        scale = left / weight
        over = {index for index in open_ if weights[index] * scale > caps[index]}
        if not over:
            exact = [weights[index] * scale if index in open_ else value for index, value in enumerate(exact)]
            break
        for index in over:
            exact[index] = caps[index]
            left -= caps[index]
        open_ -= over
    rounded = [int(value) for value in exact]
    order = sorted(range(len(raw)), key=lambda index: exact[index] - rounded[index], reverse=True)
    for index in order[: total - sum(rounded)]:
        rounded[index] += 1
    return rounded


@dataclass
class CascadingAllocation:
    """CAKE's cascading cache management (CAKE Alg. 1): prefill is split into one stage per layer.

    At stage ``m`` the layers ``0..m`` share the whole non-reserved total ``(budget − reserved) × L`` in
    proportion to their preferences, ``B_l = reserved + P_l / Σ_{k≤m} P_k · (budget − reserved) · L``, each
    capped by what it holds (earlier layers were already evicted and cannot grow back). Shares only shrink
    as stages add preferences, so the last stage is the plain proportional allocation (to a token of
    rounding), its total conserved exactly.
    """

    budget: int
    reserved: int
    num_layers: int
    preferences: list[float] = field(default_factory=list)

    def stage(self, preference: float, sizes: list[int]) -> list[int]:
        """Add the next layer's preference; budgets of layers ``0..m`` given their current ``sizes``."""
        self.preferences.append(preference)
        total = (self.budget - self.reserved) * self.num_layers
        shares = conserve_total(self.preferences, total, caps=[size - self.reserved for size in sizes])
        return [self.reserved + share for share in shares]


def cake_preference(weights: torch.Tensor, tau1: float, tau2: float) -> float:
    """CAKE's layer preference ``P = H^(1/τ1) · V^(1/τ2)`` from the window attention ``weights [B,Hq,W,T]``.

    Over the keys before the window (the window itself is always kept), summed over heads: spatial
    dispersion ``H = −Σ A log A`` (entropy) and temporal shift ``V = Σ_p Var_i(A_ip)`` (unbiased variance
    over the W window queries), as CAKE's released code computes them (``cake/model/modify_llama.py``).
    """
    prefix = weights[..., : weights.shape[-1] - weights.shape[-2]]  # [B,Hq,W,T-W]
    dispersion = -torch.special.xlogy(prefix, prefix).sum()
    shift = prefix.var(dim=-2).sum()
    return float(dispersion ** (1.0 / tau1) * shift ** (1.0 / tau2))


def vabs_preference(
    weights: torch.Tensor, approximate: torch.Tensor, values: torch.Tensor, alpha: float, beta: float, gamma: float
) -> float:
    """SLAKE's VABS preference (eqs. 15–18) from the window's true ``weights`` and PTAA ``approximate``
    weights ``[B,Hq,W,T]`` and the cached ``values [B,Hq,T,D]`` (per query head)::

        TV_hi = ½ Σ_j |Ã_ij − A_ij|                                       (eq. 15)
        VA_hi = (Σ_j ‖v_j‖ / Σ_j' ‖v_j'‖ · |Ã_ij − A_ij|)^γ                (eq. 16)
        H_hi  = −Σ_j A_ij log A_ij                                         (eq. 17, the true attention)
        P     = (E_hi[TV_hi · VA_hi])^α · (E_hi[H_hi])^β                   (eq. 18)
    """
    error = (approximate - weights).abs()  # [B,Hq,W,T]
    total_variation = 0.5 * error.sum(dim=-1)  # SLAKE eq. (15)
    norms = torch.linalg.vector_norm(values.float(), dim=-1)  # [B,Hq,T]
    share = (norms / norms.sum(dim=-1, keepdim=True))[:, :, None]
    value_aware = (share * error).sum(dim=-1) ** gamma  # SLAKE eq. (16)
    entropy = -torch.special.xlogy(weights, weights).sum(dim=-1)  # SLAKE eq. (17)
    return float((total_variation * value_aware).mean() ** alpha * entropy.mean() ** beta)  # SLAKE eq. (18)
