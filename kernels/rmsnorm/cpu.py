"""RMSNorm on the CPU: numba kernels, parallel over rows.

Forward: one task per block of rows; each row is read twice (a vectorised sum of
squares, then the scaled write), so a row stays in cache between the passes.
Backward: each task writes its rows of dx and accumulates its own partial dweight
row; a second parallel pass sums the partials by column. ``rows_per_task`` trades
parallelism against the size of that partial buffer; ``threads=1`` skips the
parallel launch, which costs more than small inputs take. float32 or bfloat16, computed in float32 (the
weight gradient is summed in float64 and rounded once). The scale is ``offset + weight`` (Gemma's ``1 + weight``),
taken in float32 as Gemma takes it; no weight is a weight of ones at offset 0 (an exact product).
x is read in place in any layout whose last dim is contiguous (``rows_of``): rows whose leading dims collapse into
one axis at the stride between rows, any others (Gemma 3's per-head q/k, [b, h, s, d] over [b, s, h, d]) through each
row's start; y, rstd and dx are contiguous, and the backward makes dy so (the registry passes it so). The kernels
take tensors by address (``at``), the weight as a numpy view that gives them the element type.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import (
    ELEMENTWISE,
    FLOATS,
    array,
    at,
    cast_to,
    empty_like,
    f32,
    helper,
    kernel,
    launch,
    rounded,
    row,
    rows_of,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from .op import RMSNORM, fake, scale, shape_problem

ROWS_PER_TASK = (1, 4, 16, 64, 256)
_COLS = 256  # columns per task of the dweight reduction
_PARALLEL_SUM = 1 << 17
"""Partial sums (tasks x columns) from which their reduction runs in parallel: below, waking the other threads
costs about what they save."""


def _forward_body(xp, span, stride, xs, w, offset, eps, rows, n, yp, rp):
    d = w.shape[0]
    x, y, rstd = at(xp, span, w.dtype), at(yp, (n, d), w.dtype), at(rp, n, np.float32)
    tasks = (n + rows - 1) // rows
    inv_d = np.float32(1.0) / np.float32(d)
    o = np.float32(offset)
    for t in prange(tasks):
        r1 = min(n, (t + 1) * rows)
        for r in range(t * rows, r1):
            xr = row(x, xs, stride, r, d)
            acc = np.float32(0.0)  # fastmath: a vectorised sum, several partial sums in flight
            for j in range(d):
                v = f32(xr[j])
                acc += v * v
            s = np.float32(1.0) / np.sqrt(acc * inv_d + np.float32(eps))
            rstd[r] = s
            for j in range(d):
                # the expression's order, (x * rstd) * w: x * w overflows where a huge x meets a huge weight,
                # and times an rstd of 0 would be nan where the expression's is 0
                y[r, j] = cast_to(y, _in_order(f32(xr[j]) * s, f32(w[j]) + o))


@helper(ELEMENTWISE)
def _in_order(a, b):
    """a * b, compiled without reassociation: LLVM reorders a product of products only where both may be."""
    return a * b


def _row_dot_body(dy, w, offset, x):
    """sum((dy * (w + offset)) * x) over a row (offset a float32), vectorised: the backward's one sum, compiled
    apart (with reassociation, which a vectorised sum needs) from the backward itself, whose element-wise products
    keep the expression's order. Its inner product is ``_in_order``'s: else LLVM takes (dy * x) * w, which
    overflows to inf, and times a weight of 0 is nan, where the expression's (dy * w) * x is 0."""
    acc = np.float32(0.0)
    for j in range(x.shape[0]):
        acc += _in_order(f32(dy[j]), f32(w[j]) + offset) * f32(x[j])
    return acc


def _backward_body(dyp, xp, span, stride, xs, w, offset, rp, rows, n, dxp, pp, tasks):
    d = w.shape[0]
    dy, x, rstd = at(dyp, (n, d), w.dtype), at(xp, span, w.dtype), at(rp, n, np.float32)
    dx, partial = at(dxp, (n, d), w.dtype), at(pp, (tasks, d), np.float32)
    o = np.float32(offset)
    for t in prange(tasks):
        p = partial[t]
        for j in range(d):
            p[j] = 0.0
        r1 = min(n, (t + 1) * rows)
        for r in range(t * rows, r1):
            s = rstd[r]
            xr = row(x, xs, stride, r, d)
            acc = _row_dot(dy[r], w, o, xr)
            # the products in the order autograd takes them through x * rsqrt(mean(x^2) + eps) * w, so that
            # a huge dy or x overflows (or not) where the expression does: dy * w, then times rstd or x;
            # rsqrt's gradient -0.5 * g * rstd^3, mean's / d, the square's times 2 * x
            c = np.float32(-0.5) * acc * (s * s * s) / np.float32(d)
            for j in range(d):
                g, v = f32(dy[r, j]), f32(xr[j])
                gw = g * (f32(w[j]) + o)
                dx[r, j] = cast_to(dx, gw * s + c * (np.float32(2.0) * v))
                p[j] += g * (v * s)


def _column_sum_body(partial, out):
    tasks, d = partial.shape
    blocks = (d + 255) // 256
    for b in prange(blocks):
        j0 = b * 256
        j1 = min(d, j0 + 256)
        acc = np.zeros(j1 - j0, np.float64)
        for t in range(tasks):
            for j in range(j0, j1):
                acc[j - j0] += partial[t, j]
        for j in range(j0, j1):
            out[j] = acc[j - j0]


_forward = kernel(_forward_body)
_row_dot = kernel(_row_dot_body)[0]  # called once per row: the serial build
_backward = kernel(_backward_body, ELEMENTWISE)
_column_sum = kernel(_column_sum_body)


def forward(tensors: tuple, attrs: dict, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = tensors
    w, offset = scale(x, w, attrs)
    y = empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
    n, threads = rstd.numel(), config["threads"]
    launch(_forward, threads, *rows_of(x), array(w), offset, attrs["eps"], max(1, -(-n // threads)), n,
           y.data_ptr(), rstd.data_ptr())
    return y, rstd


def backward(grads: tuple, tensors: tuple, results: tuple, attrs: dict, config: dict, needs: tuple) -> tuple:
    (dy,), (x, w), (_, rstd) = grads, tensors, results
    if dy.dtype is not x.dtype or not dy.is_contiguous():  # read at x's element type (the registry passes it so)
        dy = dy.to(x.dtype).contiguous()
    w, offset = scale(x, w, attrs)  # w None: no weight, or only its gradient is needed (dx is then dropped)
    dx = empty_like(x)
    n, d = rstd.numel(), x.shape[-1]
    rows = config["rows_per_task"]
    tasks = -(-n // rows)
    partial = torch.empty(tasks * d, dtype=torch.float32)  # one task's partial row is the weight's gradient
    threads = config["threads"]
    launch(_backward, threads, dy.data_ptr(), *rows_of(x), array(w), offset, rstd.data_ptr(), rows, n, dx.data_ptr(),
           partial.data_ptr(), tasks)
    if tasks == 1:
        return dx, rounded(partial, x.dtype)
    dw = torch.empty(d, dtype=torch.float32)  # rounded once to a bfloat16 weight's dtype
    launch(_column_sum, threads if d > _COLS and tasks * d >= _PARALLEL_SUM else 1, partial.numpy().reshape(tasks, d),
           dw.numpy())
    return dx, rounded(dw, x.dtype)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    x, w = specs
    wdtype = x.dtype if w is None else w.dtype
    if x.dtype not in FLOATS or wdtype != x.dtype:
        return f"dtypes {x.dtype}, {wdtype} (supports float32 or bfloat16, the same for both)"
    why = shape_problem(specs, attrs)
    if why:
        return why
    if x.layout[-1] != 1 or (w is not None and w.strides is not None and w.strides != (1,)):
        return "a last dim that is not contiguous"
    return None


def _rows(key: Key) -> int:
    xs = key.inputs[0].shape
    d = xs[-1] if xs else 1
    return max(1, (int(np.prod(xs)) // d) if d else 1)


def _fewest_tasks(n: int) -> int:
    """The ``rows_per_task`` of fewest tasks over ``n`` rows: one task where a choice covers them (its partial row
    is the weight's gradient, no reduction pass), else the largest choice."""
    return min((r for r in ROWS_PER_TASK if r >= n), default=ROWS_PER_TASK[-1])


def constraint(config: dict, key: Key) -> bool:
    n = _rows(key)
    threads = config["threads"]
    if threads > 1 and n < threads:
        return False
    if key.mode == "inference":
        return True
    rows = config["rows_per_task"]
    if threads > 1 and -(-n // rows) < threads:
        return False  # fewer tasks than threads
    return rows <= n or rows == _fewest_tasks(n)  # a choice above n is the smallest cover's config


SERIAL_BELOW = 2_097_152
"""Elements of x below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


def _fit(key: Key) -> dict[str, int]:
    """One thread below ``SERIAL_BELOW``, and then the fewest tasks: one thread has nothing to share out, and each
    task more is a partial row more to sum."""
    got = fit_threads(SERIAL_BELOW)(key)
    return {**got, "rows_per_task": _fewest_tasks(_rows(key))} if got["threads"] == 1 else got


CPU_ROWS = register_impl(Impl(
    op=RMSNORM,
    name="cpu_rows",
    backend="cpu",
    forward=forward,
    backward=backward,
    fake=fake,
    supports=supports,
    space={"threads": thread_choices(), "rows_per_task": ROWS_PER_TASK},
    default={"threads": max_threads(), "rows_per_task": 64},
    fit=_fit,
    constraint=constraint,
    backward_params=("rows_per_task",),
    saved=1,
    reads={"x": ("x", "weight", "result_1"), "weight": ("x", "result_1")},
))
