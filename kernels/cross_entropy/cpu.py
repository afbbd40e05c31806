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
from ..shared.loss import token_weight
from ..shared.sumexp_cpu import cap_into, max_sumexp, softplus64
from .op import CROSS_ENTROPY, fake, shape_problem


@helper(FASTMATH)
def _row_loss(x, r, t, ignore, online, losses, rows, i):
    """Row r of x into row i's loss (0 where ignored), max and 1 / sum of exps."""
    m, rest = max_sumexp(x, r, online, -1 if t == ignore else t)  # the sum without the target's own term
    rows[i, 0] = m
    if t == ignore:
        rows[i, 1] = np.float32(1.0) / rest
        losses[i] = 0.0
        return
    d = f32(x[r, t]) - m  # <= 0
    rows[i, 1] = np.float32(1.0) / (rest + exp32(d))
    losses[i] = softplus64(np.log(np.float64(rest)) - d)  # = lse - x_t, with no cancellation


def _forward_body(x, target, ignore, online, cap, losses, rows):
    v = x.shape[1]
    for r in prange(x.shape[0]):
        if cap > 0:  # the row capped into float32 first
            y = np.empty((1, v), np.float32)
            cap_into(x[r], cap, y[0])
            _row_loss(y, 0, target[r], ignore, online, losses, rows, r)
        else:
            _row_loss(x, r, target[r], ignore, online, losses, rows, r)


@helper(FASTMATH)
def _write_probs(xs, m, inv, scale, ds):
    """ds = exp(xs - m) / sum * scale over one row slice; returns the sum of those probabilities."""
    s = np.float32(0.0)
    for j in range(xs.shape[0]):
        p = exp32(f32(xs[j]) - m) * inv
        ds[j] = cast_to(ds, p * scale)
        s += p
    return s


@helper(FASTMATH)
def _write_capped_probs(xs, m, inv, scale, cap, ds):
    """As ``_write_probs`` of the capped logits y = cap * tanh(xs / cap) (as ``cap_into`` makes them), times
    the cap's derivative 1 - tanh(xs / cap)^2: taken from the tanh itself, so exactly 0 where it saturates, as
    PyTorch's tanh backward gives (1 - (y / cap)^2 would leave a rounding error there)."""
    s = np.float32(0.0)
    icap = np.float32(1.0) / cap
    for j in range(xs.shape[0]):
        u = tanh32(f32(xs[j]) * icap)
        p = exp32(cap * u - m) * inv
        ds[j] = cast_to(ds, p * scale * (np.float32(1.0) - u * u))
        s += p
    return s


def _backward_body(x, target, ignore, rows, scale, cap, dx):
    n, v = x.shape
    for r in prange(n):
        t = target[r]
        m, inv = rows[r, 0], rows[r, 1]
        if t == ignore:
            z = np.float32(0.0) if finite32(m) and finite32(inv) else np.float32(np.nan)  # exp(log-softmax) * 0
            for j in range(v):
                dx[r, j] = cast_to(dx, z)
            continue
        # 1 - p_target, summed from the other columns rather than cancelled; PyTorch's (p_t - 1) * scale is
        # nan where the scale is inf or nan, or the row's log-sum-exp is
        if cap > 0:
            rest = (_write_capped_probs(x[r, :t], m, inv, scale, cap, dx[r, :t])
                    + _write_capped_probs(x[r, t + 1:], m, inv, scale, cap, dx[r, t + 1:]))
            u = tanh32(f32(x[r, t]) * (np.float32(1.0) / cap))
            slope = np.float32(1.0) - u * u
        else:
            rest = (_write_probs(x[r, :t], m, inv, scale, dx[r, :t])
                    + _write_probs(x[r, t + 1:], m, inv, scale, dx[r, t + 1:]))
            slope = np.float32(1.0)
        exact = finite32(scale) and finite32(m) and finite32(inv)
        dx[r, t] = cast_to(dx, -rest * scale * slope if exact else np.float32(np.nan))


_forward = kernel(_forward_body)
_backward = kernel(_backward_body)


def _check(target: np.ndarray, v: int, ignore: int) -> None:
    bad = out_of_range(target[target != ignore], v)
    if bad is not None:
        raise IndexError(f"Target {bad} is out of bounds.")


def forward(tensors, attrs, config):
    x, target = tensors
    t = array(target)
    ignore = attrs["ignore_index"]
    _check(t, x.shape[1], ignore)
    losses = np.empty(x.shape[0], np.float64)
    rows = torch.empty((x.shape[0], 2), dtype=torch.float32)
    launch(_forward, config["threads"], array(x), t, ignore, config["online"], _cap(attrs), losses, rows.numpy())
    return torch.tensor(losses.sum() * token_weight(t, attrs), dtype=x.dtype), rows


def _cap(attrs: dict) -> np.float32:
    """The kernels' cap: 0 for none."""
    return np.float32(0.0 if attrs["softcap"] is None else attrs["softcap"])


def fake_rows(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and each row's max and 1 / sum(exp(x - max)), which the backward reads."""
    loss, _ = fake(tensors, attrs)
    return loss, tensors[0].new_empty((tensors[0].shape[0], 2), dtype=torch.float32)


def backward(grads, tensors, results, attrs, config, needs):
    (g,), (x, target), (_, rows) = grads, tensors, results
    t = array(target)
    dx = empty(x.shape, x.dtype)
    scale = float(g) * token_weight(t, attrs)
    launch(_backward, config["threads"], array(x), t, attrs["ignore_index"], array(rows), np.float32(scale),
           _cap(attrs), array(dx))
    return (dx,)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    """Logits in any layout; int64 targets (PyTorch takes no other class indices)."""
    return shape_problem(specs, attrs) or require(specs, {0: FLOATS, 1: ("int64",)}, contiguous=False)


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
    reads={"logits": ("logits", "target", "result_1")},
))
