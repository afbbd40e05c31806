"""Medians and bootstrap intervals of paired timings (``scipy.stats.bootstrap``)."""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
MIN_ROUNDS = 6
"""Rounds below which no interval of a median reaches 95%: with n rounds, the one between the smallest and the
largest covers it with probability 1 - 2 / 2^n (97% at 6, 75% at 3), and a bootstrap claims more than that."""


def median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def _interval(data: tuple, statistic, seed: int, paired: bool) -> tuple[float, float]:
    if len(data[0]) < 2:
        v = float(statistic(*data))
        return v, v
    from scipy import stats  # not at import: the command line reads MIN_ROUNDS before any measurement

    res = stats.bootstrap(data, statistic, paired=paired, confidence_level=LEVEL, n_resamples=2000,
                          method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    lo, hi = res.confidence_interval
    return float(lo), float(hi)


def bootstrap_ci(values, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the median of ``values``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return _interval((v,), lambda x, axis=-1: np.median(x, axis=axis), seed, paired=False)


def ratio_of_medians(num, den, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """median(num) / median(den), with a 95% interval from resampling the rounds in pairs.

    With num = compiler times and den = kernel times this is the speedup; the point estimate is exactly the
    ratio of the two medians an entry reports, so its numbers agree with each other."""
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)

    def ratio(x, y, axis=-1):
        return np.median(x, axis=axis) / np.median(y, axis=axis)

    return float(ratio(a, b)), _interval((a, b), ratio, seed, paired=True)


def paired_difference(a, b, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """median(a - b) over paired rounds, with a 95% interval (a saving, where a is the slower variant)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return median(d), bootstrap_ci(d, seed)
