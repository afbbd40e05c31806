"""RoPE on the CPU (numba): queries and keys rotated in one pass over each (batch, position).

Each task owns whole positions, so it also owns their rows of the cos and sin gradients
(summed over heads) with no conflicts; where cos and sin have batch 1 for a larger q/k batch (what Hugging
Face passes without position_ids), a task owns its positions in every batch, whose gradients it sums too.
``positions_per_task`` sets the grain. q and k are read in place in any layout, Hugging Face's transposed
views (``x.view(b, s, h, d).transpose(1, 2)``) included; float32 or bfloat16, computed in float32.
"""

from __future__ import annotations

import torch
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from .._cpu import FLOATS, array, cast_to, f32, inline, kernel, launch, max_threads, require, thread_choices
from .op import ROPE, fake, shape_problem

POSITIONS = (1, 8, 64)


@inline
def _rotate(x, c, s, b, cb, heads, p, half, out):
    """out = x * cos + rot(x) * sin for every head at (b, p); cos and sin of batch cb."""
    cr, sr = c[cb, p], s[cb, p]
    for h in range(heads):
        xr, orow = x[b, h, p], out[b, h, p]
        for j in range(half):
            a, z = f32(xr[j]), f32(xr[j + half])
            orow[j] = cast_to(orow, a * f32(cr[j]) - z * f32(sr[j]))
            orow[j + half] = cast_to(orow, z * f32(cr[j + half]) + a * f32(sr[j + half]))


@inline
def _task(t, nbc, nb, ns, grain):
    """Task t's batches, cos/sin batch and positions: tasks run over (block of ``grain`` positions, cos/sin
    batch), batch fastest; a cos/sin batch of 1 for a larger q/k batch takes every batch."""
    p0 = (t // nbc) * grain
    cb = t % nbc
    b0, b1 = (cb, cb + 1) if nbc == nb else (0, nb)
    return b0, b1, cb, p0, min(ns, p0 + grain)


def _forward_body(q, k, c, s, grain, qo, ko):
    nb, hq, ns, d = q.shape
    nbc = c.shape[0]
    hk = k.shape[1]
    half = d // 2
    for t in prange(nbc * ((ns + grain - 1) // grain)):
        b0, b1, cb, p0, p1 = _task(t, nbc, nb, ns, grain)
        for b in range(b0, b1):
            for p in range(p0, p1):
                _rotate(q, c, s, b, cb, hq, p, half, qo)
                _rotate(k, c, s, b, cb, hk, p, half, ko)


@inline
def _rotate_back(x, g, c, s, b, cb, heads, p, half, dx, dc, ds):
    """dx = the rotation of g by -angle; dcos += g * x and dsin += g * rot(x), summed over heads."""
    cr, sr, dcr, dsr = c[cb, p], s[cb, p], dc[cb, p], ds[cb, p]
    for h in range(heads):
        xr, gr, dr = x[b, h, p], g[b, h, p], dx[b, h, p]
        for j in range(half):
            a, z = f32(xr[j]), f32(xr[j + half])
            ga, gz = f32(gr[j]), f32(gr[j + half])
            dr[j] = cast_to(dr, ga * f32(cr[j]) + gz * f32(sr[j + half]))
            dr[j + half] = cast_to(dr, gz * f32(cr[j + half]) - ga * f32(sr[j]))
            dcr[j] += ga * a
            dcr[j + half] += gz * z
            dsr[j] -= ga * z
            dsr[j + half] += gz * a


def _backward_body(gq, gk, q, k, c, s, grain, dq, dk, dc, ds):
    nb, hq, ns, d = q.shape
    nbc = c.shape[0]
    hk = k.shape[1]
    half = d // 2
    for t in prange(nbc * ((ns + grain - 1) // grain)):
        b0, b1, cb, p0, p1 = _task(t, nbc, nb, ns, grain)
        for p in range(p0, p1):
            for j in range(d):
                dc[cb, p, j] = 0.0
                ds[cb, p, j] = 0.0
            for b in range(b0, b1):
                _rotate_back(q, gq, c, s, b, cb, hq, p, half, dq, dc, ds)
                _rotate_back(k, gk, c, s, b, cb, hk, p, half, dk, dc, ds)


_forward = kernel(_forward_body)
_backward = kernel(_backward_body)


def forward(tensors, attrs, config):
    q, k, c, s = tensors
    qo, ko = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    launch(_forward, config["threads"], array(q), array(k), array(c), array(s), config["positions_per_task"],
           array(qo), array(ko))
    return qo, ko


def backward(grads, tensors, results, attrs, config):
    (gq, gk), (q, k, c, s) = grads, tensors
    dq, dk = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    dc, ds = torch.empty(c.shape), torch.empty(s.shape)  # float32 sums, rounded once to bfloat16 cos/sin
    launch(_backward, config["threads"], array(gq), array(gk), array(q), array(k), array(c), array(s),
           config["positions_per_task"], array(dq), array(dk), dc.numpy(), ds.numpy())
    return dq, dk, dc.to(c.dtype), ds.to(s.dtype)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    """Any strides (transposed q/k views are read in place), one float dtype for all four."""
    return shape_problem(specs, attrs) or require(specs, {i: FLOATS for i in range(4)}, contiguous=False)


def constraint(config: dict, key: Key) -> bool:
    _, _, n, _ = key.inputs[0].shape
    tasks = key.inputs[2].shape[0] * -(-n // config["positions_per_task"])
    return config["threads"] == 1 or tasks >= config["threads"]


CPU_POSITIONS = register_impl(Impl(
    op=ROPE, name="cpu_positions", backend="cpu", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"threads": thread_choices(), "positions_per_task": POSITIONS},
    default={"threads": max_threads(), "positions_per_task": 8}, constraint=constraint,
))
