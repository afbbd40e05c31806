"""What the two CPU losses (``cross_entropy.cpu_rows``, ``linear_cross_entropy.cpu_chunks``) share per row beyond
the max and sum of exponentials: the options' extra sums (the class-weighted sum of lse - logit for label smoothing,
the argmax for predicted tokens), each row's gradient coefficients, and the loss assembled from the rows' terms
(the formulas: ``shared.loss``)."""

from __future__ import annotations

import numpy as np
import torch

from ...registry.cpu.runtime import FASTMATH, f32, helper, inline
from .loss import Shares


@helper(FASTMATH)
def weighted_sum(row, lse, w, has_w):
    """sum_c w_c * (lse - row_c) in float64 (w_c = 1 where not ``has_w``): label smoothing's term, each of its
    terms at least 0 (no cancellation; an infinite weight gives inf, as PyTorch)."""
    s = 0.0
    if has_w:
        for j in range(row.shape[0]):
            s += np.float64(w[j]) * (lse - np.float64(f32(row[j])))
    else:
        for j in range(row.shape[0]):
            s += lse - np.float64(f32(row[j]))
    return s


@helper(set())
def argmax(row):
    """The first index of the row's max, or of its first nan (``torch.argmax``'s answer)."""
    best = np.float32(-np.inf)
    at = 0
    for j in range(row.shape[0]):
        v = f32(row[j])
        if v != v:
            return j
        if v > best:
            best = v
            at = j
    return at


def class_weights(weight: torch.Tensor | None) -> tuple[np.ndarray, bool]:
    """The class weights as the kernels read them (float32; an empty array for none), and whether there are any."""
    if weight is None:
        return np.empty(0, np.float32), False
    return weight.detach().float().contiguous().numpy(), True


@inline
def log_sum_exp(m, log_sum):
    """m + log(sum of exp(x - m)) in float64; m itself where m is not finite (an infinite or nan row, as
    torch.logsumexp gives, not inf - inf)."""
    if not np.isfinite(m):
        return np.float64(m)
    return np.float64(m) + log_sum


@inline
def coefficients(omega, lse, k, kz, eps, eps_v, w_sum, s):
    """Row i's gradient a * p - c * w - b * onehot(t) (``shared.loss``): (a, b, c, a - b) in float32, a - b taken
    in float64 (the options' share at the target, which a float32 difference would round away)."""
    b = k * (1.0 - eps) * omega
    c = k * eps_v if eps_v != 0 else 0.0  # each option's term only where it is on: 0 * an infinite k or lse is nan
    e = c * w_sum if eps_v != 0 else 0.0
    if s != 0:
        e += kz * 2.0 * s * lse
    return np.float32(b + e), np.float32(b), np.float32(c), np.float32(e)


def assemble(sh: Shares, nll: np.ndarray, lse: np.ndarray, wsum: np.ndarray, attrs: dict
             ) -> tuple[np.ndarray | float, np.ndarray | float]:
    """The loss and its z-loss term from each row's nll (lse - z_t), lse and smoothing sum (``weighted_sum``),
    float64: per row for ``none``, else reduced. The z-loss is part of the loss."""
    eps, s = attrs["label_smoothing"], attrs["lse_square_scale"]
    ce = (1.0 - eps) * sh.omega * nll
    if eps:
        ce = ce + np.where(sh.valid, sh.eps_v * wsum, 0.0)
    if s:
        with np.errstate(over="ignore"):  # lse^2 in float32, as the expression squares it: inf past 1.8e19
            zl = np.where(sh.valid, s * np.square(lse.astype(np.float32)).astype(np.float64), 0.0)
    else:
        zl = np.zeros_like(nll)
    if attrs["reduction"] == "none":
        return ce + zl, zl
    zsum = zl.sum() * sh.kz if s else 0.0
    return ce.sum() * sh.k + zsum, zsum
