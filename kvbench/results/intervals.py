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
from collections.abc import Callable, Mapping, Sequence
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


#: the resamples drawn, and averaged, at a time: ``[BLOCK, n]`` values in flight rather than ``[resamples, n]``
BLOCK = 1_000


@functools.lru_cache(maxsize=4)
def draws(seed: int, size: int, resamples: int) -> np.ndarray:
    """The resamples' indices ``[resamples, size]`` into ``size`` samples (or clusters), drawn with replacement by a
    generator seeded ``seed``; read-only (one array for every caller of these arguments). Held in the smallest
    unsigned type that fits (2 bytes each up to 65,536 samples, not 8) and drawn ``BLOCK`` resamples at a time, the
    values numpy's single ``integers(0, size, (resamples, size))`` draws (its stream does not depend on the blocks)."""
    generator = np.random.default_rng(seed)
    drawn = np.empty((resamples, size), dtype=np.min_scalar_type(max(size - 1, 0)))
    for start in range(0, resamples, BLOCK):
        rows = min(BLOCK, resamples - start)
        drawn[start : start + rows] = generator.integers(0, size, size=(rows, size))
    drawn.setflags(write=False)
    return drawn


def blocked(statistic: Callable[[np.ndarray], np.ndarray], drawn: np.ndarray) -> np.ndarray:
    """``statistic`` of each resample's indices ``drawn [R,n]`` (a row's value, ``[r,n] → [r]``), ``BLOCK`` rows at
    a time."""
    return np.concatenate([statistic(drawn[start : start + BLOCK]) for start in range(0, len(drawn), BLOCK)])


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
        means = blocked(lambda rows: sample[rows].mean(axis=1), draws(seed, sample.size, resamples))  # [R]
    else:
        _, cluster = np.unique(np.asarray(clusters, dtype=str), return_inverse=True)  # [n] each value's cluster
        sums, sizes = np.bincount(cluster, weights=sample), np.bincount(cluster)  # [C], [C]
        drawn = draws(seed, sums.size, resamples)  # [R,C]
        means = blocked(lambda rows: sums[rows].sum(axis=1) / sizes[rows].sum(axis=1), drawn)  # [R]
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
