"""Layer budgets: how an average per-layer budget is shared over the layers.

A strategy is a small dataclass that owns its parameters and, where a paper tunes them per model, the
table of per-model values (keyed by the model's Hugging Face id, filled in by :meth:`LayerBudget.for_model`
when a parameter is ``None``). A policy holds one (``policy.layer_budget``; Hydra: ``{name: pyramid,
beta: 20.0}``, or just ``policy.layer_budget=cake`` for a strategy with its defaults).

* ``uniform`` (here): every layer keeps the budget.
* ``pyramid`` (``pyramidkv.py``): PyramidKV eq. 7, budgets falling linearly from the bottom layer to the top.
* ``cake`` (``cake.py``) and ``vabs`` (``slake.py``) are *dynamic*: each layer's preference is scored from
  its observation-window attention during prefill and the total is shared in CAKE's cascading manner
  (:meth:`LayerBudget.cascade` over :class:`CascadingAllocation`, called by the cache at each layer of the
  first evicting forward): CAKE's preference (entropy and variance of
  attention), or SLAKE's value-aware budget scores (eqs. 15–18).

Each paper's strategy lives in that paper's policy file and registers itself with ``@register``
(``kvbench.policies.registry``, one decorator for bases, modifiers and layer budgets).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from kvbench.budgets import Budget
from kvbench.errors import check_keys, choose
from kvbench.policies.registry import LAYER_BUDGETS, Registered, register

if TYPE_CHECKING:
    from kvbench.policies.stats import AttentionStats


@dataclass
class LayerBudget(Registered):
    """Splits ``budget × num_layers`` tokens over layers (the reserved sinks/window in every layer)."""

    registry = "layer budget"
    settings_prefix = "policy.layer_budget."
    #: allocated during prefill from the layers' attention (the cache calls :meth:`preference`)
    dynamic: ClassVar[bool] = False
    #: whether :meth:`preference` reads the slots the average budget would evict (else it is handed None)
    reads_evicted: ClassVar[bool] = True

    def allocate(self, budget: int, num_layers: int, reserved: int, prompt_len: int) -> list[int]:
        """Per-layer budgets before the prompt is seen; dynamic strategies start uniform."""
        return [budget] * num_layers

    def for_model(self, model_id: str | None, budget: Budget) -> LayerBudget:
        """This strategy with its per-model values filled in where a parameter is ``None``."""
        return self

    def observation_window(self, scoring_window: int) -> int:
        """Recent queries whose attention gives a dynamic strategy's layer preference: the policy's scoring
        window, or CAKE's default observation window of 32 where that is a single query (TOVA)."""
        return scoring_window if scoring_window > 1 else 32

    def preference(self, stats: AttentionStats, evicted: torch.Tensor | None) -> torch.Tensor:
        """A dynamic strategy's preference (0-d, left on the device) of one layer from its window attention
        ``stats`` and the slots ``evicted [B,Hc,T]`` that the average budget would evict (where it
        :attr:`reads_evicted`)."""
        raise NotImplementedError

    def allocation(self, budget: int, reserved: int, num_layers: int) -> CascadingAllocation:
        """The cascading allocation of a dynamic strategy (its rounding: :class:`CascadingAllocation`)."""
        return CascadingAllocation(budget, reserved, num_layers)

    def cascade(self, allocation: CascadingAllocation, cache: CascadedCache, layer_idx: int, scaling: float) -> None:
        """Stage ``layer_idx`` of CAKE Alg. 1 in ``cache``: rank the layer at the average budget, score its
        :meth:`preference` from its observation window and the slots that budget would evict, then
        :meth:`share` — now, or when the forward ends where the cache defers its stages (each preference would
        otherwise be read back to the host at its layer, a synchronisation per layer on a GPU). Dynamic
        strategies only."""
        scores = cache.rank(layer_idx, allocation.budget, scaling)  # [B,Hc,T]
        evicted = cache.evicted_by(layer_idx, allocation.budget, scores) if self.reads_evicted else None  # [B,Hc,T]
        stats = cache.preference_stats(layer_idx, scaling)
        preference = self.preference(stats, evicted)
        if cache.defers:
            allocation.deferred.append(preference)
            cache.defer(layer_idx)
        else:
            stats.settle()  # a shared prefill's preference is computed with the others' when its layer ends
            self.share(allocation, cache, layer_idx, float(preference), scaling)

    def share(
        self, allocation: CascadingAllocation, cache: CascadedCache, layer_idx: int, preference: float, scaling: float
    ) -> None:
        """Re-share the total over layers ``0..layer_idx`` given the stage's ``preference``
        (:meth:`CascadingAllocation.stage`) and evict each layer holding more than its share (the earlier ones by the
        ranking of their own stage)."""
        sizes = [cache.layer_size(index) for index in range(layer_idx + 1)]
        budgets = allocation.stage(preference, sizes)
        cache.layer_budgets[: layer_idx + 1] = budgets
        for index, (size, budget) in enumerate(zip(sizes, budgets)):
            if size > budget:
                cache.evict(index, budget, scaling)

    def parameters(self) -> dict[str, Any]:
        """``{"name": ..., **fields}``: the Hydra node of this strategy."""
        return {"name": self.name, **asdict(self)}


@register
@dataclass
class Uniform(LayerBudget):
    """Every layer keeps the same budget."""

    name = "uniform"
    paper = "—"


@dataclass
class DynamicLayerBudget(LayerBudget):
    """Budgets from each layer's preference during prefill (CAKE Alg. 1's cascading allocation)."""

    dynamic = True


def build_layer_budget(spec: LayerBudget | str | Mapping[str, Any]) -> LayerBudget:
    """A strategy from its name (defaults) or its Hydra node ``{name: ..., <parameter>: ...}``."""
    if isinstance(spec, LayerBudget):
        return spec
    node = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = check_layer_budget_keys(node)
    node.pop("name")
    return LAYER_BUDGETS[name](**node)


def check_layer_budget_keys(node: Mapping[str, Any]) -> str:
    """One-line errors for an unknown strategy ``name`` or a key it does not read; returns the name."""
    name = node.get("name")
    choose("policy.layer_budget", name, LAYER_BUDGETS)
    assert isinstance(name, str)  # one of LAYER_BUDGETS
    check_keys(node, layer_budget_keys(name), "policy.layer_budget.", f"layer budget {name}")
    return name


def layer_budget_keys(name: str) -> list[str]:
    """The settings of layer budget ``name`` (``policy.layer_budget.<key>``): ``name`` and its fields."""
    return ["name", *sorted(f.name for f in fields(LAYER_BUDGETS[name]))]


def conserve_total(raw: Sequence[float], total: int, caps: list[int] | None = None) -> list[int]:
    """Round shares ``∝ raw`` (non-negative; all zero = equal) to integers summing to ``total`` (largest
    remainders first). With ``caps`` no share exceeds its cap: capped shares are fixed and the rest of the
    total is shared again in proportion (water-filling); if the caps hold less than ``total``, all are full."""
    caps_or_inf: list[float] = [math.inf] * len(raw) if caps is None else list(caps)
    if caps is not None and total >= sum(caps):
        return list(caps)
    weights = list(raw) if sum(raw) > 0 else [1.0] * len(raw)
    exact, open_, left = [0.0] * len(raw), set(range(len(raw))), float(total)
    while open_:
        weight = sum(weights[index] for index in open_)
        if weight == 0:  # only zero-preference shares remain open: they split the rest equally
            weights = [1.0 if index in open_ else value for index, value in enumerate(weights)]
            continue
        scale = left / weight
        over = {index for index in open_ if weights[index] * scale > caps_or_inf[index]}
        if not over:
            exact = [weights[index] * scale if index in open_ else value for index, value in enumerate(exact)]
            break
        for index in over:
            exact[index] = caps_or_inf[index]
            left -= caps_or_inf[index]
        open_ -= over
    rounded = [int(value) for value in exact]
    order = sorted(range(len(raw)), key=lambda index: exact[index] - rounded[index], reverse=True)
    for index in order[: total - sum(rounded)]:
        rounded[index] += 1
    return rounded


def released_shares(raw: list[float], total: int, cap: int) -> list[int]:
    """Shares ``∝ raw`` rounded as CAKE's release rounds them (antgroup/cakekv ``cake/utils.py`` ``adjust_budgets``,
    its float32 arithmetic): each ``raw_l / Σ raw · total`` truncated; each capped at ``cap``, the excess spread
    evenly over the uncapped shares; then the shortfall to ``total`` spread evenly over the shares under ``cap``
    (an overshoot taken from those above 1). Each spread gives its remainder one token each to the lowest layers."""
    values = np.asarray(raw, dtype=np.float32)
    summed = np.float32(0)
    for value in values:  # the release's Python sum over float32 scalars
        summed = np.float32(summed + value)
    shares = (values / summed * np.float32(total)).astype(np.int64)
    excess = int(np.maximum(shares - cap, 0).sum())
    shares = np.minimum(shares, cap)
    if excess > 0:
        spread(shares, shares < cap, excess)
    difference = total - int(shares.sum())
    if difference:
        spread(shares, shares < cap if difference > 0 else shares > 1, difference)
    return [int(share) for share in shares]


def spread(shares: np.ndarray, open_: np.ndarray, amount: int) -> None:
    """Add ``amount`` (negative: take) evenly over the ``open_`` shares, the remainder one each to the lowest."""
    indices = np.flatnonzero(open_)
    if len(indices):
        each, left = divmod(abs(amount), len(indices))
        sign = 1 if amount > 0 else -1
        shares[indices] += sign * each
        shares[indices[:left]] += sign


class CascadedCache(Protocol):
    """What a dynamic strategy's :meth:`~LayerBudget.cascade` sees of the cache it allocates
    (``kvbench.engine.cascade.CascadeStages``): per-layer budgets it re-shares, and per layer its size, a ranking at
    a budget (kept as the layer's ranking), the attention of its observation window, the slots a budget would
    evict, and eviction to a budget by the kept ranking."""

    @property
    def layer_budgets(self) -> list[int]: ...  # re-shared in place

    @property
    def defers(self) -> bool: ...  # whether the stages are shared when the forward ends (their preferences kept)

    def defer(self, layer_idx: int) -> None: ...  # the stage of ``layer_idx`` is to be shared then

    def layer_size(self, layer_idx: int) -> int: ...

    def rank(self, layer_idx: int, budget: int, scaling: float) -> torch.Tensor: ...

    def preference_stats(self, layer_idx: int, scaling: float) -> AttentionStats: ...

    def evicted_by(self, layer_idx: int, budget: int, scores: torch.Tensor) -> torch.Tensor: ...

    def evict(self, layer_idx: int, budget: int, scaling: float) -> None: ...


@dataclass
class CascadingAllocation:
    """CAKE's cascading cache management (CAKE Alg. 1): prefill is split into one stage per layer.

    At stage ``m`` the layers ``0..m`` share the whole non-reserved total ``(budget − reserved) × L`` in
    proportion to their preferences, ``B_l = reserved + P_l / Σ_{k≤m} P_k · (budget − reserved) · L``, each
    capped by what it holds (earlier layers were already evicted and cannot grow back). Shares only shrink
    as stages add preferences, so the last stage is the plain proportional allocation (to a token of
    rounding), its total conserved exactly.

    ``released``: rounded as CAKE's release rounds (:func:`released_shares`, capped at the prompt), then each
    share cut to what its layer holds; the tokens cut are lost, as there.
    """

    budget: int
    reserved: int
    num_layers: int
    released: bool = False
    preferences: list[float] = field(default_factory=list)
    #: the preferences of the stages yet to be shared (0-d tensors, read back at once: :meth:`LayerBudget.cascade`)
    deferred: list[torch.Tensor] = field(default_factory=list)

    @property
    def stages(self) -> int:
        """The stages scored so far: shared and deferred."""
        return len(self.preferences) + len(self.deferred)

    def stage(self, preference: float, sizes: list[int]) -> list[int]:
        """Add the next layer's preference; budgets of layers ``0..m`` given their current ``sizes`` (the last,
        layer ``m``'s, is the prompt: it has not been evicted)."""
        self.preferences.append(preference)
        total = (self.budget - self.reserved) * self.num_layers
        caps = [size - self.reserved for size in sizes]
        if self.released:
            shares = [min(share, cap) for share, cap in zip(released_shares(self.preferences, total, caps[-1]), caps)]
        else:
            shares = conserve_total(self.preferences, total, caps=caps)
        return [self.reserved + share for share in shares]
