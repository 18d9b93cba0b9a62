"""Intervals over samples: a cell's mean with its percentile-bootstrap interval, and a method's paired difference from
another on the same samples (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13: resample the
samples with replacement, take the statistic of each resample, read the interval off its quantiles; paired: resample
the sample ids, so each resample compares both methods on the same samples). Samples that share a context (questions
asked about one document) are not independent: given their clusters, whole clusters are resampled (the cluster
bootstrap, Davison & Hinkley, *Bootstrap Methods and their Application*, 1997, §3.8), each resample's mean the mean
over the samples of the clusters drawn.

Resampling is vectorised: one ``[resamples, clusters]`` index draw, one mean per row. The draw depends only on the
seed, the number of samples (or clusters) and the resamples, so the cells of a leaderboard, mostly of one size, read
one draw (:func:`draws`), the same a fresh generator makes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: bootstrap resamples and the interval's coverage
RESAMPLES = 10_000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` samples and its bootstrap interval ``[low, high]``."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies on one side of zero (for a difference: the methods differ at this level)."""
        return self.low > 0 or self.high < 0


@functools.lru_cache(maxsize=4)
def draws(seed: int, size: int, resamples: int) -> np.ndarray:
    """The resamples' indices ``[resamples, size]`` into ``size`` samples (or clusters), drawn with replacement by a
    generator seeded ``seed``; read-only (one array for every caller of these arguments)."""
    drawn = np.random.default_rng(seed).integers(0, size, size=(resamples, size))
    drawn.setflags(write=False)
    return drawn


def bootstrap_mean(
    values: Sequence[float],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
    clusters: Sequence[str] | None = None,
) -> Interval:
    """The mean of ``values`` with its ``level`` percentile-bootstrap interval over ``resamples`` resamples (the
    same ``seed``, the same interval); with ``clusters`` (each value's), whole clusters resampled."""
    sample = np.asarray(values, dtype=np.float64)
    if sample.size == 0:
        raise ValueError("bootstrap_mean needs at least one value")
    if clusters is None:
        means = sample[draws(seed, sample.size, resamples)].mean(axis=1)  # [R] of [R,n]
    else:
        _, cluster = np.unique(np.asarray(clusters, dtype=str), return_inverse=True)  # [n] each value's cluster
        sums, sizes = np.bincount(cluster, weights=sample), np.bincount(cluster)  # [C], [C]
        drawn = draws(seed, sums.size, resamples)  # [R,C]
        means = sums[drawn].sum(axis=1) / sizes[drawn].sum(axis=1)  # [R]
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(sample.mean()), float(low), float(high), int(sample.size))


def paired_difference(
    treated: Mapping[str, float],
    control: Mapping[str, float],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
    clusters: Mapping[str, str] | None = None,
) -> Interval:
    """The mean of ``treated − control`` over the sample ids both scored, with its paired bootstrap interval (with
    ``clusters``, each sample id's cluster: whole clusters resampled)."""
    shared = sorted(set(treated) & set(control))
    if not shared:
        raise ValueError("paired_difference needs samples scored by both")
    differences = [treated[key] - control[key] for key in shared]
    of = None if clusters is None else [clusters.get(key, key) for key in shared]
    return bootstrap_mean(differences, resamples, level, seed, of)
