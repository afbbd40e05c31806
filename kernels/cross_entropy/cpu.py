"""Cross-entropy on the CPU (numba), parallel over rows.

Forward keeps only each row's max and the reciprocal of its sum of exps past the max (two floats: one
log-sum-exp would round the log of the sum away where the max is large), never the softmax; backward
recomputes exp(logit - max) / sum as it writes the gradient, so a large vocabulary's softmax is materialised
once, as the gradient itself. ``online=1`` (the default) finds max and sum in one pass over memory, part by part
(``shared.sumexp_cpu.max_sumexp``), ``online=0`` in two passes over each row (the same where a row fits in L1).
The target's own exponential is kept out of the sum: the loss is then softplus(log(rest) - (x_t - max)) and
the target's gradient -rest, both exact even when the target's probability rounds to 1.
float32 or bfloat16 logits (computed in float32, the loss summed in float64). An ignored row adds nothing to
the loss, and its gradient is 0, or nan where its log-softmax is nan (a nan, +inf or all -inf row), as
PyTorch's log-softmax backward gives. With ``softcap`` each row is capped into a float32 row first
(``shared.sumexp_cpu.cap_into``: cap * tanh(x / cap)) and the backward recomputes the cap as it writes the
gradient, times the cap's derivative 1 - tanh(x / cap)^2.
The options (``shared.loss``) cost a pass only where they are on: label smoothing one more over each row (the
class-weighted sum of lse - logit, in float64), predicted tokens an argmax; class weights and the z-loss only change
each row's coefficients, and ``reduction="none"`` the backward's per-row gradient.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import (
    FASTMATH,
    FLOATS,
    array,
    cast_to,
    empty,
    exp32,
    f32,
    finite32,
    helper,
    kernel,
    launch,
    out_of_range,
    require,
    tanh32,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from ..shared.loss import shares
from ..shared.loss_cpu import argmax, assemble, class_weights, coefficients, log_sum_exp, weighted_sum
from ..shared.sumexp_cpu import cap_into, max_sumexp, softplus64
from .op import CROSS_ENTROPY, fake, shape_problem


@helper(FASTMATH)
def _row_loss(x, r, t, ignore, online, smooth, w, has_w, nll, lse, wsum, rows, i):
    """Row r of x into row i's nll (lse - x_t), lse, smoothing sum (``weighted_sum``, where ``smooth``), max
    and 1 / sum of exps; 0 where ignored."""
    m, rest = max_sumexp(x, r, online, -1 if t == ignore else t)  # the sum without the target's own term
    rows[i, 0] = m
    if t == ignore:
        rows[i, 1] = np.float32(1.0) / rest
        nll[i] = lse[i] = wsum[i] = 0.0
        return
    d = f32(x[r, t]) - m  # <= 0
    rows[i, 1] = np.float32(1.0) / (rest + exp32(d))
    nll[i] = softplus64(np.log(np.float64(rest)) - d)  # = lse - x_t, with no cancellation
    lse[i] = log_sum_exp(m, np.log(np.float64(rest) + np.exp(np.float64(d))))
    if smooth:
        wsum[i] = weighted_sum(x[r], lse[i], w, has_w)


def _forward_body(x, target, ignore, online, cap, smooth, w, has_w, predict, nll, lse, wsum, pred, rows):
    v = x.shape[1]
    for r in prange(x.shape[0]):
        t = target[r]
        if cap > 0:  # the row capped into float32 first
            y = np.empty((1, v), np.float32)
            cap_into(x[r], cap, y[0])
            _row_loss(y, 0, t, ignore, online, smooth, w, has_w, nll, lse, wsum, rows, r)
            if predict:
                pred[r] = -1 if t == ignore else argmax(y[0])
        else:
            _row_loss(x, r, t, ignore, online, smooth, w, has_w, nll, lse, wsum, rows, r)
            if predict:
                pred[r] = -1 if t == ignore else argmax(x[r])


@helper(FASTMATH)
def _write_probs(xs, m, inv, a, c, w, has_w, ds):
    """ds = a * p - c * w over one row slice, p = exp(xs - m) / sum; returns the sum of those p."""
    s = np.float32(0.0)
    if c == 0:
        for j in range(xs.shape[0]):
            p = exp32(f32(xs[j]) - m) * inv
            ds[j] = cast_to(ds, p * a)
            s += p
    elif has_w:
        for j in range(xs.shape[0]):
            p = exp32(f32(xs[j]) - m) * inv
            ds[j] = cast_to(ds, p * a - c * w[j])
            s += p
    else:
        for j in range(xs.shape[0]):
            p = exp32(f32(xs[j]) - m) * inv
            ds[j] = cast_to(ds, p * a - c)
            s += p
    return s


@helper(FASTMATH)
def _write_capped_probs(xs, m, inv, a, c, w, has_w, cap, ds):
    """As ``_write_probs`` of the capped logits y = cap * tanh(xs / cap) (as ``cap_into`` makes them), times
    the cap's derivative 1 - tanh(xs / cap)^2: taken from the tanh itself, so exactly 0 where it saturates, as
    PyTorch's tanh backward gives (1 - (y / cap)^2 would leave a rounding error there)."""
    s = np.float32(0.0)
    icap = np.float32(1.0) / cap
    for j in range(xs.shape[0]):
        u = tanh32(f32(xs[j]) * icap)
        p = exp32(cap * u - m) * inv
        g = p * a if c == 0 else p * a - c * (w[j] if has_w else np.float32(1.0))
        ds[j] = cast_to(ds, g * (np.float32(1.0) - u * u))
        s += p
    return s


def _backward_body(x, target, ignore, rows, gs, omega, k, kz, eps, eps_v, w_sum, s, cap, w, has_w, dx):
    n, v = x.shape
    for r in prange(n):
        t = target[r]
        m, inv = rows[r, 0], rows[r, 1]
        if t == ignore:
            z = np.float32(0.0) if finite32(m) and finite32(inv) else np.float32(np.nan)  # exp(log-softmax) * 0
            for j in range(v):
                dx[r, j] = cast_to(dx, z)
            continue
        g = np.float64(gs[r])
        a, b, c, e = coefficients(omega[r], log_sum_exp(m, -np.log(np.float64(inv))), k * g, kz * g, eps, eps_v,
                               w_sum, s)
        wl, wr = (w[:t], w[t + 1:]) if has_w else (w, w)
        # 1 - p_target, summed from the other columns rather than cancelled; PyTorch's (p_t - 1) * scale is
        # nan where the scale is inf or nan, or the row's log-sum-exp is
        if cap > 0:
            rest = (_write_capped_probs(x[r, :t], m, inv, a, c, wl, has_w, cap, dx[r, :t])
                    + _write_capped_probs(x[r, t + 1:], m, inv, a, c, wr, has_w, cap, dx[r, t + 1:]))
            u = tanh32(f32(x[r, t]) * (np.float32(1.0) / cap))
            yt, slope = cap * u, np.float32(1.0) - u * u
        else:
            rest = (_write_probs(x[r, :t], m, inv, a, c, wl, has_w, dx[r, :t])
                    + _write_probs(x[r, t + 1:], m, inv, a, c, wr, has_w, dx[r, t + 1:]))
            yt, slope = f32(x[r, t]), np.float32(1.0)
        exact = finite32(a) and finite32(m) and finite32(inv)
        own = -rest * b
        if e != 0 or c != 0:  # the options' share of the target's own column
            own += e * exp32(yt - m) * inv - c * (w[t] if has_w else np.float32(1.0))
        dx[r, t] = cast_to(dx, own * slope if exact else np.float32(np.nan))


_forward = kernel(_forward_body)
_backward = kernel(_backward_body)


def _check(target: np.ndarray, v: int, ignore: int) -> None:
    bad = out_of_range(target[target != ignore], v)
    if bad is not None:
        raise IndexError(f"Target {bad} is out of bounds.")


def forward(tensors, attrs, config):
    x, target, weight = tensors
    n, v = x.shape
    t = array(target)
    ignore = attrs["ignore_index"]
    _check(t, v, ignore)
    sh = shares(t, weight, v, attrs)
    w, has_w = class_weights(weight)
    nll, lse, wsum = np.zeros(n), np.zeros(n), np.zeros(n)
    pred = torch.empty(n if attrs["predictions"] else 0, dtype=torch.int64)
    rows = torch.empty((n, 2), dtype=torch.float32)
    launch(_forward, config["threads"], array(x), t, ignore, config["online"], _cap(attrs),
           attrs["label_smoothing"] > 0, w, has_w, attrs["predictions"], nll, lse, wsum, pred.numpy(), rows.numpy())
    loss, zl = assemble(sh, nll, lse, wsum, attrs)
    return torch.as_tensor(loss, dtype=x.dtype), torch.as_tensor(zl, dtype=x.dtype), pred, rows


def _cap(attrs: dict) -> np.float32:
    """The kernels' cap: 0 for none."""
    return np.float32(0.0 if attrs["softcap"] is None else attrs["softcap"])


def fake_rows(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, ...]:
    """The loss, its z-loss term, the predicted tokens, and each row's max and 1 / sum(exp(x - max)), which the
    backward reads."""
    return (*fake(tensors, attrs)[:3], tensors[0].new_empty((tensors[0].shape[0], 2), dtype=torch.float32))


def backward(grads, tensors, results, attrs, config, needs):
    g, (x, target, weight), rows = grads[0], tensors, results[3]
    t = array(target)
    n, v = x.shape
    dx = empty(x.shape, x.dtype)
    sh = shares(t, weight, v, attrs)
    w, has_w = class_weights(weight)
    gs = g.detach().double().reshape(-1).expand(n).contiguous().numpy()  # a per-token gradient for ``none``
    launch(_backward, config["threads"], array(x), t, attrs["ignore_index"], array(rows), gs, sh.omega, sh.k, sh.kz,
           attrs["label_smoothing"], sh.eps_v, sh.w_sum, attrs["lse_square_scale"], _cap(attrs), w, has_w,
           array(dx))
    return (dx,)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    """Logits in any layout; int64 targets (PyTorch takes no other class indices); class weights of either float
    dtype, whatever the logits' (bfloat16 logits with float32 weights, as Liger takes them)."""
    return shape_problem(specs, attrs) or require(specs[:2], {0: FLOATS, 1: ("int64",)}, contiguous=False) or \
        require(specs[2:], {0: FLOATS}, contiguous=False)


def constraint(config: dict, key: Key) -> bool:
    return config["threads"] == 1 or key.inputs[0].shape[0] >= config["threads"]


SERIAL_BELOW = 2_097_152
"""Elements of logits below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_ROWS = register_impl(Impl(
    op=CROSS_ENTROPY, name="cpu_rows", backend="cpu", forward=forward, backward=backward, fake=fake_rows,
    supports=supports, space={"threads": thread_choices(), "online": (0, 1)},
    default={"threads": max_threads(), "online": 1}, constraint=constraint, saved=1,
    fit=fit_threads(SERIAL_BELOW),
    reads={"logits": ("logits", "target", "weight", "result_3")},
))
