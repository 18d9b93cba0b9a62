"""What the variants of one shared forward compute once at a layer (:class:`~kvbench.engine.batches.SharedPrefill`),
each table by what it holds: the first variant that needs an entry computes it, the others read it. A table's key
says what its entry depends on beyond the layer's entries, which the variants share."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.policies.base import AttentionStats

#: a selection's kept slots ``[B,Hc,K]`` and the entries gathered by them (keys, values, positions)
Selection = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class SharedForward:
    """One layer's shared results in one shared forward: the entries of ``layer``, every table's key past them."""

    layer: int
    #: the window statistics of the last ``size`` queries, by size (:meth:`~kvbench.engine.scoring.Scorer.window`)
    windows: dict[int, AttentionStats] = field(default_factory=dict)
    #: the rankings ``[B,Hc,T]``, by :meth:`~kvbench.engine.scoring.Scorer.ranking_key`
    rankings: dict[tuple, torch.Tensor] = field(default_factory=dict)
    #: the selections, by :meth:`~kvbench.engine.cache.EvictionCache._selection_key` (a ranking, a budget)
    selections: dict[tuple, Selection] = field(default_factory=dict)
    #: the entries a selection evicted, handed to the attending modifiers, by the selection's key
    evicted: dict[tuple, Any] = field(default_factory=dict)
    #: the last queries ``[B,Hq,W,D]`` and their positions ``[W]`` the variants hold, by window ``W``
    queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: what a policy computes from the entries and the layer's weights alone, by the policy's name for it
    #: (:meth:`~kvbench.policies.context.ScoreContext.once`)
    entries: dict[Hashable, Any] = field(default_factory=dict)
