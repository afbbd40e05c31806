"""What the gated activations ``act(gate) * up`` (SwiGLU, GeGLU) share on the CPU (numba): one fused elementwise
pass, forward and backward (float32 or bfloat16, computed in float32), with the activation bound per op.

The work is split into tasks of ``block`` elements: small blocks balance the threads, large ones keep each thread
streaming; ``threads=1`` skips the parallel launch. Gate and up may also be rows with a stride (the last dim
contiguous, the leading dims collapsing into one row axis): the two halves of one ``gate_up`` projection (Phi-3's
fused MLP), read in place, a row per task.
"""

from __future__ import annotations

import torch
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import (
    ELEMENTWISE,
    FLOATS,
    array,
    as_rows,
    cast_to,
    empty_like,
    f32,
    kernel,
    launch,
    require,
    rows_view,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from .activations_cpu import gelu_tanh, gelu_tanh_grad, silu, silu_grad

BLOCKS = (4096, 16384, 65536)
ACT = ACT_GRAD = None
"""The gate's activation in the loops below, and its (value, derivative): ``gated_kernels`` binds each op's."""


def _forward_body(g, u, block, out):
    n = g.size
    for t in prange((n + block - 1) // block):
        lo, hi = t * block, min(n, (t + 1) * block)
        gb, ub, ob = g[lo:hi], u[lo:hi], out[lo:hi]  # slices: the inner loop vectorises
        for i in range(hi - lo):
            ob[i] = cast_to(ob, ACT(f32(gb[i])) * f32(ub[i]))


def _backward_body(dy, g, u, block, dg, du):
    n = g.size
    for t in prange((n + block - 1) // block):
        lo, hi = t * block, min(n, (t + 1) * block)
        yb, gb, ub, dgb, dub = dy[lo:hi], g[lo:hi], u[lo:hi], dg[lo:hi], du[lo:hi]
        for i in range(hi - lo):
            x, gy, up = f32(gb[i]), f32(yb[i]), f32(ub[i])  # all read before any write: dg, du may be g, u
            a, da = ACT_GRAD(x)
            dub[i] = cast_to(dub, gy * a)
            dgb[i] = cast_to(dgb, gy * up * da)


def _forward_rows_body(g, u, out):
    """The forward on [rows, dim] arrays of any row stride, a row per task."""
    for r in prange(g.shape[0]):
        gb, ub, ob = g[r], u[r], out[r]
        for i in range(g.shape[1]):
            ob[i] = cast_to(ob, ACT(f32(gb[i])) * f32(ub[i]))


def _backward_rows_body(dy, g, u, dg, du):
    for r in prange(g.shape[0]):
        yb, gb, ub, dgb, dub = dy[r], g[r], u[r], dg[r], du[r]
        for i in range(g.shape[1]):
            x, gy, up = f32(gb[i]), f32(yb[i]), f32(ub[i])
            a, da = ACT_GRAD(x)
            dub[i] = cast_to(dub, gy * a)
            dgb[i] = cast_to(dgb, gy * up * da)


def gated_kernels(act, act_grad) -> tuple[tuple, ...]:
    """The forward and backward kernels of ``act(gate) * up``, flat and by rows: ``act(x)`` and ``act_grad(x) ->
    (act(x), act'(x))`` are ``inline`` numba functions, bound in place of ``ACT`` and ``ACT_GRAD``."""
    bind = {"ACT": act, "ACT_GRAD": act_grad}
    return tuple(kernel(body, ELEMENTWISE, bind)
                 for body in (_forward_body, _backward_body, _forward_rows_body, _backward_rows_body))


SILU = gated_kernels(silu, silu_grad)
GELU_TANH = gated_kernels(gelu_tanh, gelu_tanh_grad)
"""The gated kernels of SwiGLU and GeGLU (and of the gated MLP's activation)."""


def _flat(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


def gated_forward(kernels: tuple, tensors: tuple, config: dict) -> tuple:
    g, u = tensors
    out = empty_like(g)
    if _flat(g, u):
        launch(kernels[0], config["threads"], array(g).reshape(-1), array(u).reshape(-1), config["block"],
               array(out).reshape(-1))
    else:
        launch(kernels[2], config["threads"], as_rows(g), as_rows(u), as_rows(out))
    return (out,)


def gated_backward(kernels: tuple, grads: tuple, tensors: tuple, config: dict, out: tuple | None = None) -> tuple:
    """dg and du, new or into ``out`` (which may be g and u themselves: each element is read before it is
    written)."""
    (dy,), (g, u) = grads, tensors
    u = g if u is None else u  # only du (which reads g) is needed: dg is computed and dropped
    dg, du = (empty_like(g), empty_like(g)) if out is None else out
    if _flat(dy, g, u):
        launch(kernels[1], config["threads"], array(dy).reshape(-1), array(g).reshape(-1), array(u).reshape(-1),
               config["block"], array(dg).reshape(-1), array(du).reshape(-1))
    else:
        launch(kernels[3], config["threads"], as_rows(dy), as_rows(g), as_rows(u), as_rows(dg), as_rows(du))
    return dg, du


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    g, u = specs
    if g.shape != u.shape:
        return f"shapes {list(g.shape)} and {list(u.shape)} (no broadcasting)"
    why = require(specs, {0: FLOATS, 1: FLOATS}, contiguous=False)
    if why or (g.is_contiguous and u.is_contiguous):
        return why
    if not all(s.shape and s.layout[-1] == 1 and rows_view(s.shape, s.strides) for s in specs):
        return "a layout whose rows are not contiguous or do not collapse into one row axis without a copy"
    return None


def constraint(config: dict, key: Key) -> bool:
    n = key.inputs[0].numel
    tasks = -(-n // config["block"])
    if config["threads"] > 1 and tasks < config["threads"]:
        return False
    return config["block"] == min(BLOCKS) or config["block"] <= n  # larger blocks than the tensor are all alike


def gated_impl(op, forward, backward, fake, serial_below: int) -> Impl:
    """The CPU impl ``cpu_fused`` of a gated op ``act(gate) * up`` (the same space, constraint and reads)."""
    return register_impl(Impl(
        op=op, name="cpu_fused", backend="cpu", forward=forward, backward=backward, fake=fake, supports=supports,
        space={"threads": thread_choices(), "block": BLOCKS},
        default={"threads": max_threads(), "block": 16384}, constraint=constraint,
        fit=fit_threads(serial_below),
        reads={"gate": ("gate", "up"), "up": ("gate",)},
    ))
