"""Softmax over the last dim on the CPU (numba), parallel over rows.

``online=1``: two passes over each row, a running max and rescaled sum, then the
write (more exponentials, less memory traffic); ``online=0``: three passes, max,
then exp stored into the output with its sum, then one scaling pass (vectorises).
Backward: dx = y * (dy - sum(dy * y)) from the saved output, with dy shifted by c, its value at the peak
where some y is above one half (exact because sum(y) = 1). Without the shift a peaked row, y_peak within an
ulp of 1, computes the peak's gradient as a difference of nearly equal numbers and keeps no correct digit.
No shift where dy at the peak is inf or nan (nothing to keep; PyTorch's nan and inf then land where its
formula puts them), nor for a bfloat16 y, whose rounded values do not sum to 1.
float32 or bfloat16 (computed in float32; the bfloat16 output is what the backward reads, as in PyTorch).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import (
    FLOATS,
    as_rows,
    cast_to,
    empty_like,
    exp32,
    f32,
    finite32,
    fmax32,
    holds_f32,
    kernel,
    launch,
    require,
    rows_view,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from ..shared.sumexp_cpu import max_sumexp
from .op import SOFTMAX, dim_problem, fake


def _forward_body(x, online, y):
    n, d = x.shape
    keep = holds_f32(y)  # a float32 output holds the exps between passes; a bfloat16 one would round them
    for r in prange(n):
        if online:  # max and sum in one pass, then the write
            m, s = max_sumexp(x, r, 1)
            inv = np.float32(1.0) / s
            for j in range(d):
                y[r, j] = cast_to(y, exp32(f32(x[r, j]) - m) * inv)
        else:  # max; exp (stored) and its sum; one scaling pass
            m = np.float32(-np.inf)
            for j in range(d):
                m = fmax32(m, f32(x[r, j]))
            s = np.float32(0.0)
            for j in range(d):
                e = exp32(f32(x[r, j]) - m)
                if keep:
                    y[r, j] = cast_to(y, e)
                s += e
            inv = np.float32(1.0) / s
            if keep:
                for j in range(d):
                    y[r, j] = cast_to(y, f32(y[r, j]) * inv)
            else:
                for j in range(d):
                    y[r, j] = cast_to(y, exp32(f32(x[r, j]) - m) * inv)


def _backward_body(dy, y, dx):
    n, d = y.shape
    half = np.float32(0.5)
    zero = np.float32(0.0)
    shift = holds_f32(y)  # a bfloat16 y does not sum to 1 closely enough for the shift to be exact
    for r in prange(n):
        # (elements are loaded before any conditional expression: a load inside one keeps the loop scalar)
        at_peak = zero  # dy at the peak, the one entry above one half if there is one
        if shift:
            for j in range(d):
                yj, g = f32(y[r, j]), f32(dy[r, j])
                at_peak += zero if yj <= half else g
        peak = shift and finite32(at_peak)  # an inf or nan dy: no digits to keep; PyTorch's own nan and inf
        c = at_peak if peak else zero
        acc = zero  # sum(y * (dy - c)): the peak's own term is exactly 0
        for j in range(d):
            acc += f32(y[r, j]) * (f32(dy[r, j]) - c)
        for j in range(d):  # the peak apart: fastmath may regroup (dy - c) - acc as dy - (c + acc)
            yj, g = f32(y[r, j]), f32(dy[r, j])
            v = yj * -acc if peak and yj > half else yj * ((g - c) - acc)
            dx[r, j] = cast_to(dx, v)


_forward = kernel(_forward_body)
_backward = kernel(_backward_body)


def forward(tensors, attrs, config):
    (x,) = tensors
    y = empty_like(x)
    launch(_forward, config["threads"], as_rows(x), config["online"], as_rows(y))
    return (y,)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (y,) = grads, results
    dx = empty_like(y)
    launch(_backward, config["threads"], as_rows(dy), as_rows(y), as_rows(dx))
    return (dx,)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = require(specs, {0: FLOATS}, contiguous=False) or dim_problem(specs, attrs)
    if why:
        return why
    (x,) = specs
    if x.shape and x.layout[-1] != 1 or not rows_view(x.shape, x.strides):
        return "a layout whose rows are not contiguous or do not collapse into one row axis without a copy"
    return None


def constraint(config: dict, key: Key) -> bool:
    shape = key.inputs[0].shape
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return config["threads"] == 1 or rows >= config["threads"]


SERIAL_BELOW = 2_097_152
"""Elements of x below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_ROWS = register_impl(Impl(
    op=SOFTMAX, name="cpu_rows", backend="cpu", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"threads": thread_choices(), "online": (0, 1)},
    default={"threads": max_threads(), "online": 0}, constraint=constraint, reads={"x": ("result_0",)},
    fit=fit_threads(SERIAL_BELOW),
))
