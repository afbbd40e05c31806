"""The experts on the CPU: the (token, expert) pairs sorted by expert once (a numba counting sort), each expert's
rows one contiguous block, its two products on the faster library at the site (torch's BLAS, MKL's, or oneDNN's:
a tuned choice, ``shared/products.py``), the gated activation and the routing weight fused into one numba pass over
the block, and each block's rows added back into their tokens (in a float32 sum, experts in order: deterministic).

Backward reuses the sort: each expert's block of output gradients (gathered by the same order) through the down
product, one fused pass giving the gate and up gradients, the routing weights' gradient and the weighted activation
(recomputed from the saved gate and up, not stored), then the three products of the block; the hidden gradient
added back per token as in the forward. Only the gate and up of the routed rows [T * K, 2I] are saved; every other
buffer is one block's. The products run in the inputs' dtype (bfloat16 on AVX-512 BF16 where the
inputs are); the passes between them compute in float32."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ...registry import Impl, Key, register_impl
from ...registry.cpu.runtime import ELEMENTWISE, FLOATS, array, cast_to, empty, f32, kernel, launch, out_of_range
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from ..shared.activations_cpu import gelu, gelu_grad, gelu_tanh, gelu_tanh_grad, silu, silu_grad
from ..shared.products import ONEDNN, allowed, onednn_enabled
from ..shared.products import product as _product
from .op import MOE_EXPERTS, fake, shape_problem

ACT = ACT_GRAD = None
"""The gate's activation in the passes below, and its (value, derivative): bound per ``act``."""


@njit(cache=True, nogil=True)
def _route(idx, experts, order, offsets):
    """Pairs p = t * K + k sorted by expert (stable): ``order`` the sorted pairs (those naming expert ``experts``,
    none, at the end, not counted), ``offsets[e]:offsets[e + 1]`` expert e's rows."""
    counts = np.zeros(experts + 2, np.int64)
    for p in range(idx.size):
        counts[idx[p] + 1] += 1
    for e in range(experts + 1):
        counts[e + 1] += counts[e]
    offsets[:] = counts[:experts + 1]
    for p in range(idx.size):
        e = idx[p]
        r = counts[e]
        counts[e] += 1
        order[r] = p


def _act_body(gu, w, rows, width, a):
    """a[r] = act(gate[r]) * up[r] * w[r] for the first ``rows`` rows; gate and up the halves of gu[r]."""
    for r in prange(rows):
        g, ar = gu[r], a[r]
        s = f32(w[r])
        for i in range(width):
            ar[i] = cast_to(ar, ACT(f32(g[i])) * f32(g[width + i]) * s)


def _act_grad_body(gu, w, da, rows, width, dgu, a, dw):
    """From dA (the weighted activation's gradient): dgate, dup, the weight's gradient <dA, act(gate) * up>, and
    the weighted activation again (the down weight's gradient reads it)."""
    for r in prange(rows):
        g, dar, dg, ar = gu[r], da[r], dgu[r], a[r]
        s = f32(w[r])
        acc = np.float32(0.0)
        for i in range(width):
            x, u, d = f32(g[i]), f32(g[width + i]), f32(dar[i])
            v, dv = ACT_GRAD(x)
            h = v * u
            acc += d * h
            ar[i] = cast_to(ar, h * s)
            ds = d * s
            dg[i] = cast_to(dg, ds * u * dv)
            dg[width + i] = cast_to(dg, ds * v)
        dw[r] = acc


_ACTS = {"silu": (silu, silu_grad), "gelu_pytorch_tanh": (gelu_tanh, gelu_tanh_grad), "gelu": (gelu, gelu_grad)}
_KERNELS = {name: (kernel(_act_body, ELEMENTWISE, {"ACT": f}), kernel(_act_grad_body, ELEMENTWISE, {"ACT_GRAD": g}))
            for name, (f, g) in _ACTS.items()}


def routing(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [S], offsets [E + 1]) of the pairs sorted by expert (``_route``); an index outside [0, E] is an
    IndexError, as the expression's scatter gives."""
    idx = array(top_k_index.reshape(-1).to(torch.int64).contiguous())
    bad = out_of_range(idx, experts + 1)
    if bad is not None:
        raise IndexError(f"moe_experts: top_k_index {bad} is out of bounds for {experts} experts (0..{experts})")
    order, offsets = torch.empty(idx.size, dtype=torch.int64), torch.empty(experts + 1, dtype=torch.int64)
    _route(idx, experts, order.numpy(), offsets.numpy())
    return order, offsets


def _blocks(offsets: torch.Tensor):
    """(expert, first row, last row) of each expert with rows."""
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            yield e, bounds[e], bounds[e + 1]


def _unrouted(offsets: torch.Tensor):
    bounds = offsets.tolist()
    return [e for e in range(len(bounds) - 1) if bounds[e + 1] == bounds[e]]


def _accumulator(like: torch.Tensor) -> torch.Tensor:
    """Where the blocks' rows are summed back per token: float32 zeros (the result itself for float32)."""
    return torch.zeros(like.shape, dtype=torch.float32)


def forward(tensors, attrs, config):
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj = tensors
    t, k = top_k_index.shape
    e, i = down_proj.shape[0], down_proj.shape[2]
    dtype, onednn = hidden.dtype, onednn_enabled(config["fwd_onednn"])
    order, offsets = routing(top_k_index, e)
    rows = int(offsets[-1])
    tok = order[:rows] // k
    ws = top_k_weights.detach().reshape(-1).float().index_select(0, order[:rows])
    gu = torch.empty((t * k, 2 * i), dtype=dtype)
    x, wgu, wd = hidden.detach(), gate_up_proj.detach(), down_proj.detach()
    acc = _accumulator(hidden)
    act = _KERNELS[attrs["act"]][0]
    for ex, lo, hi in _blocks(offsets):
        tb = tok[lo:hi]
        _product(x.index_select(0, tb), wgu[ex], onednn, out=gu[lo:hi])
        a = torch.empty((hi - lo, i), dtype=dtype)
        launch(act, config["threads"], array(gu[lo:hi]), ws[lo:hi].numpy(), hi - lo, i, array(a))
        acc.index_add_(0, tb, _product(a, wd[ex], onednn).float())
    return acc.to(dtype), gu, order, offsets


def backward(grads, tensors, results, attrs, config, needs):
    (dout,), (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj) = grads, tensors
    _, gu, order, offsets = results
    t, k = top_k_index.shape
    e, h, i = down_proj.shape
    dtype, rows = hidden.dtype, int(offsets[-1])
    dgrad, wgrad = onednn_enabled(config["dgrad_onednn"]), onednn_enabled(config["wgrad_onednn"])
    tok = order[:rows] // k
    ws = top_k_weights.detach().reshape(-1).float().index_select(0, order[:rows])
    dws = torch.empty(rows, dtype=torch.float32)
    x, wgu, wd, dout = hidden.detach(), gate_up_proj.detach(), down_proj.detach(), dout.contiguous()
    need_h, need_w, need_gu, need_d = needs
    dh = _accumulator(hidden) if need_h else None
    d_gu = empty(tuple(wgu.shape), wgu.dtype) if need_gu else None  # the output pool: no first-touch faults
    d_down = empty(tuple(wd.shape), wd.dtype) if need_d else None
    for ex in _unrouted(offsets):  # experts no token reached: zero gradients
        for g in (d_gu, d_down):
            if g is not None:
                g[ex].zero_()
    grad = _KERNELS[attrs["act"]][1]
    for ex, lo, hi in _blocks(offsets):
        tb, n = tok[lo:hi], hi - lo
        dy = dout.index_select(0, tb)
        da = _product(dy, wd[ex].t(), dgrad)
        dg, a = torch.empty((n, 2 * i), dtype=dtype), torch.empty((n, i), dtype=dtype)
        launch(grad, config["threads"], array(gu[lo:hi]), ws[lo:hi].numpy(), array(da), n, i, array(dg), array(a),
               dws[lo:hi].numpy())
        if need_d:
            _product(dy.t(), a.t(), wgrad, out=d_down[ex])
        if need_gu:
            _product(dg.t(), x.index_select(0, tb).t(), wgrad, out=d_gu[ex])
        if need_h:
            dh.index_add_(0, tb, _product(dg, wgu[ex].t(), dgrad).float())
    dw = None
    if need_w:
        flat = torch.zeros(t * k, dtype=torch.float32)
        flat[order[:rows]] = dws
        dw = flat.view(t, k).to(top_k_weights.dtype)
    return None if dh is None else dh.to(dtype), dw, d_gu, d_down


def impl_fake(tensors, attrs):
    hidden, top_k_index, _, _, down_proj = tensors
    t, k = top_k_index.shape
    n = t * k
    e, i = down_proj.shape[0], down_proj.shape[2]
    idx = top_k_index.new_empty(n, dtype=torch.int64)
    return (*fake(tensors, attrs), hidden.new_empty((n, 2 * i)), idx, top_k_index.new_empty(e + 1, dtype=torch.int64))


def supports(specs, attrs) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    hidden, _, w, gu, down = specs
    if hidden.dtype not in FLOATS or gu.dtype != hidden.dtype or down.dtype != hidden.dtype:
        return (f"hidden {hidden.dtype}, gate_up_proj {gu.dtype}, down_proj {down.dtype} (supports one of "
                f"{', '.join(FLOATS)} for all three)")
    if not w.is_float:
        return f"top_k_weights of {w.dtype} (supports a float dtype)"
    return None


def _work(key: Key) -> int:
    """The elements of the routed gate and up: T * K * 2I."""
    idx, gu = key.inputs[1], key.inputs[3]
    return idx.numel * gu.shape[1]


_LIBRARIES = ("fwd_onednn", "dgrad_onednn", "wgrad_onednn")
"""Per pass, oneDNN's products or torch's mm: the forward's two, the input gradients' two (down's and gate-and-up's),
the weight gradients' two."""

_READS = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj", "result_1", "result_2",
          "result_3")
"""What every gradient reads: the inputs and the saved gate-and-up and routing (not the output)."""

SERIAL_BELOW = 262_144
"""Routed gate-and-up elements below which the default config runs the passes on one thread."""

CPU_GROUPED = register_impl(Impl(
    op=MOE_EXPERTS, name="cpu_grouped", backend="cpu", forward=forward, backward=backward, fake=impl_fake,
    supports=supports, saved=3,
    space={"threads": thread_choices(), **{p: (0, 1) for p in _LIBRARIES}},
    default={"threads": max_threads(), "fwd_onednn": int(ONEDNN), "dgrad_onednn": int(ONEDNN), "wgrad_onednn": 0},
    constraint=lambda config, key: allowed(config, _LIBRARIES, key.inputs[0].dtype),
    backward_params=("dgrad_onednn", "wgrad_onednn"),
    fit=fit_threads(SERIAL_BELOW, _work),
    reads={name: _READS for name in MOE_EXPERTS.differentiable},
))
