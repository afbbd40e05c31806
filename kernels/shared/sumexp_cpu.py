"""The row pass that softmax and the cross-entropy losses share on the CPU: a row's max and sum of exponentials in
one pass over it (part by part, each while it sits in L1), and the softcap of the logits."""

from __future__ import annotations

import numba
import numpy as np

from ...registry.cpu.runtime import FASTMATH, exp32, f32, fmax32, helper, inline, tanh32


@helper(FASTMATH)
def cap_into(xs, cap, ys):
    """ys = cap * tanh(xs / cap) in float32 (the softcap of Gemma 2 and 3's logits); ys may be xs."""
    inv = np.float32(1.0) / cap
    for j in range(xs.shape[0]):
        ys[j] = cap * tanh32(f32(xs[j]) * inv)


PART = 512
"""Columns per step of the one-pass max and sum (2 KiB of float32): a part's max and its exponentials are taken
while it sits in L1, so a row longer than the caches is read from memory once, and the next parts stream in while
this one's exponentials are computed (faster than parts of 1024 or two passes: docs/benchmarks.md, "Figures behind
the code")."""


@inline
def max_sumexp(x, r, online, skip=-1):
    """Row r's max m and the sum of exp(x - m) over every column but ``skip``: in one pass over the row, part by
    part, rescaling the sum where a part raises the max (online), or in two passes. Leaving a column out of the
    sum, rather than subtracting it afterwards, keeps the rest of a peaked row exact (cross-entropy's loss and
    gradient at a confident target)."""
    row = x[r]
    if not online:
        m = np.float32(-np.inf)
        for j in range(row.shape[0]):
            m = fmax32(m, f32(row[j]))
        return m, _sumexp_without(row, m, skip)
    m = np.float32(-np.inf)
    s = np.float32(0.0)
    for lo in range(0, row.shape[0], PART):
        part = row[lo:lo + PART]
        mp = m
        for j in range(part.shape[0]):
            mp = fmax32(mp, f32(part[j]))
        if mp != m:  # the max rose (or is nan: then so is the sum, as in two passes)
            s *= exp32(m - mp)
            m = mp
        if m != -np.inf:  # a part of -inf only adds exp(-inf) = 0, not exp(-inf - -inf) = nan: the max may rise
            s += _sumexp_without(part, m, skip - lo)
    return m, s


@helper(FASTMATH)
def _sumexp_without(row, m, skip):
    """The sum of exp(row - m) over every column but ``skip`` (none where it lies outside the row)."""
    if skip < 0 or skip >= row.shape[0]:
        return sumexp(row, m)
    # two slices: a per-column skip test, or a loop from a run-time start, defeats the vectoriser
    return sumexp(row[:skip], m) + sumexp(row[skip + 1:], m)


@inline
def sumexp(row, m):
    s = np.float32(0.0)
    for j in range(row.shape[0]):
        s += exp32(f32(row[j]) - m)
    return s


@numba.njit(inline="always", error_model="numpy")
def softplus64(z):
    """log(1 + exp(z)) in float64 without overflow, exact to a few ulps for tiny results."""
    return z + np.log1p(np.exp(-z)) if z > 0.0 else np.log1p(np.exp(z))
