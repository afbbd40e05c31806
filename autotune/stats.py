"""Medians and bootstrap intervals of paired timings (numpy only)."""

from __future__ import annotations

import numpy as np


def median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def bootstrap_ci(values, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.size, size=(resamples, v.size))
    meds = np.median(v[idx], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def paired_speedup(compiler_s, kernel_s, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """Median and 95% interval of the per-round ratio compiler/kernel (> 1: the kernel is faster)."""
    c = np.asarray(compiler_s, dtype=np.float64)
    k = np.asarray(kernel_s, dtype=np.float64)
    ratios = c / np.maximum(k, 1e-12)
    return median(ratios), bootstrap_ci(ratios, seed=seed)
