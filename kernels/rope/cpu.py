"""RoPE on the CPU (numba): queries and keys rotated in one pass over each (batch, position).

Each task owns whole positions, so it also owns their rows of the cos and sin gradients
(summed over heads) with no conflicts; where cos and sin have batch 1 for a larger q/k batch (what Hugging
Face passes without position_ids), a task owns its positions in every batch, whose gradients it sums too.
``positions_per_task`` sets the grain. q and k are read in place in any layout: contiguous, or Hugging Face's
transposed views (``x.view(b, s, h, d).transpose(1, 2)``) as their [b, s, h, d] memory, both at full speed,
any other through its strides. The outputs keep their input's layout where it is dense (a transposed view stays
transposed, as PyTorch's element-wise ops keep it), and every array is walked in its memory order: a task's rows
then stream, where a walk across the layout touches as many cache lines at a time as it has rows.
float32 or bfloat16, computed in float32.
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
    cast_to,
    empty,
    f32,
    fma32,
    helper,
    kernel,
    launch,
    require,
    rounded,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from .op import ROPE, shape_problem

POSITIONS = (1, 8, 64)


@helper(ELEMENTWISE)
def _row(x, bshd, b, h, p):
    """Head h's row at position p of batch b, from x stored [b, h, s, d] or (``bshd``) [b, s, h, d]."""
    i, k = (p, h) if bshd else (h, p)  # two integers chosen, one view made
    return x[b, i, k]


@helper(ELEMENTWISE)
def _heads_of(x, xt):
    """(batch, heads, positions, dim) of x stored [b, h, s, d] or (``xt``) [b, s, h, d]."""
    b, i, k, d = x.shape
    return (b, k, i, d) if xt else (b, i, k, d)


@helper(ELEMENTWISE)
def _walk(bshd, heads, p0, p1, u, v):
    """(head, position) of step (u, v) of a walk over ``heads`` x [p0, p1) in memory order: a position's heads are
    adjacent in [b, s, h, d] (``bshd``), a head's positions in [b, h, s, d]. Rows read in memory order stream;
    a walk across the other way touches a row every seq x dim (or heads x dim) floats, as many streams as rows."""
    return (v, p0 + u) if bshd else (u, p0 + v)


@helper(ELEMENTWISE)
def _extent(bshd, heads, p0, p1):
    return (p1 - p0, heads) if bshd else (heads, p1 - p0)


@helper(ELEMENTWISE)
def _rotate(x, xt, c, s, b, cb, heads, p0, p1, half, out, ot):
    """out = x * cos + rot(x) * sin for every head at positions [p0, p1) of batch b; cos and sin of batch cb.
    Walked in the output's memory order."""
    nu, nv = _extent(ot, heads, p0, p1)
    for u in range(nu):
        for v in range(nv):
            h, p = _walk(ot, heads, p0, p1, u, v)
            xr, orow, cr, sr = _row(x, xt, b, h, p), _row(out, ot, b, h, p), c[cb, p], s[cb, p]
            # fused where a factor is a cos (in [-1, 1]: its product cannot overflow alone); a loop per half
            # of the row, each writing one range, vectorises (two writes in one loop need an overlap check)
            for j in range(half):
                orow[j] = cast_to(orow, fma32(f32(xr[j]), f32(cr[j]), -(f32(xr[j + half]) * f32(sr[j]))))
            for j in range(half):
                orow[j + half] = cast_to(orow, fma32(f32(xr[j + half]), f32(cr[j + half]),
                                                     f32(xr[j]) * f32(sr[j + half])))


@helper(ELEMENTWISE)
def _task(t, nbc, nb, ns, grain):
    """Task t's batches, cos/sin batch and positions: tasks run over (block of ``grain`` positions, cos/sin
    batch), batch fastest; a cos/sin batch of 1 for a larger q/k batch takes every batch."""
    p0 = (t // nbc) * grain
    cb = t % nbc
    b0, b1 = (cb, cb + 1) if nbc == nb else (0, nb)
    return b0, b1, cb, p0, min(ns, p0 + grain)


def _forward_body(q, qt, k, kt, c, s, grain, qo, qot, ko, kot):
    nb, hq, ns, _ = _heads_of(qo, qot)
    nbc = c.shape[0]
    hk = _heads_of(ko, kot)[1]
    half = qo.shape[3] // 2
    for t in prange(nbc * ((ns + grain - 1) // grain)):
        b0, b1, cb, p0, p1 = _task(t, nbc, nb, ns, grain)
        for b in range(b0, b1):
            _rotate(q, qt, c, s, b, cb, hq, p0, p1, half, qo, qot)
            _rotate(k, kt, c, s, b, cb, hk, p0, p1, half, ko, kot)


@helper(ELEMENTWISE)
def _unrotate(g, gt, c, s, b, cb, heads, p0, p1, half, dx):
    """dx = the rotation of g by -angle, for every head at positions [p0, p1) of batch b; g and dx in one
    layout (``gt`` as ``_row``), walked in its memory order."""
    nu, nv = _extent(gt, heads, p0, p1)
    for u in range(nu):
        for v in range(nv):
            h, p = _walk(gt, heads, p0, p1, u, v)
            gr, dr, cr, sr = _row(g, gt, b, h, p), _row(dx, gt, b, h, p), c[cb, p], s[cb, p]
            for j in range(half):  # a loop per half, as in _rotate
                dr[j] = cast_to(dr, fma32(f32(gr[j]), f32(cr[j]), f32(gr[j + half]) * f32(sr[j + half])))
            for j in range(half):
                dr[j + half] = cast_to(dr, fma32(f32(gr[j + half]), f32(cr[j + half]), -(f32(gr[j]) * f32(sr[j]))))


@helper(ELEMENTWISE)
def _accumulate(x, xt, g, gt, b, cb, heads, p0, p1, half, dc, ds):
    """dcos += g * x and dsin += g * rot(x) at positions [p0, p1) of batch b, summed over heads, walked in g's
    memory order: loops of one output each, which vectorise (several outputs in one loop would each need a
    run-time overlap check)."""
    nu, nv = _extent(gt, heads, p0, p1)
    for u in range(nu):
        for v in range(nv):
            h, p = _walk(gt, heads, p0, p1, u, v)
            xr, gr, dcr, dsr = _row(x, xt, b, h, p), _row(g, gt, b, h, p), dc[cb, p], ds[cb, p]
            for j in range(2 * half):
                dcr[j] += f32(gr[j]) * f32(xr[j])
            for j in range(half):
                dsr[j] -= f32(gr[j]) * f32(xr[j + half])
            for j in range(half):
                dsr[j + half] += f32(gr[j + half]) * f32(xr[j])


@helper(ELEMENTWISE)
def _grad_dims(gq, gqt, gk, gkt, c, grain):
    """(batches, q heads, k heads, positions, dim, cos/sin batches, tasks) of a backward."""
    nb, hq, ns, d = _heads_of(gq, gqt)
    nbc = c.shape[0]
    return nb, hq, _heads_of(gk, gkt)[1], ns, d, nbc, nbc * ((ns + grain - 1) // grain)


def _backward_body(gq, gqt, gk, gkt, q, qt, k, kt, c, s, grain, dq, dk, dc, ds):
    nb, hq, hk, ns, d, nbc, tasks = _grad_dims(gq, gqt, gk, gkt, c, grain)
    half = d // 2
    for t in prange(tasks):
        b0, b1, cb, p0, p1 = _task(t, nbc, nb, ns, grain)
        for p in range(p0, p1):
            for j in range(d):
                dc[cb, p, j] = 0.0
                ds[cb, p, j] = 0.0
        for b in range(b0, b1):
            _unrotate(gq, gqt, c, s, b, cb, hq, p0, p1, half, dq)
            _unrotate(gk, gkt, c, s, b, cb, hk, p0, p1, half, dk)
            _accumulate(q, qt, gq, gqt, b, cb, hq, p0, p1, half, dc, ds)
            _accumulate(k, kt, gk, gkt, b, cb, hk, p0, p1, half, dc, ds)


def _backward_qk_body(gq, gqt, gk, gkt, c, s, grain, dq, dk):
    nb, hq, hk, ns, d, nbc, tasks = _grad_dims(gq, gqt, gk, gkt, c, grain)
    half = d // 2
    for t in prange(tasks):
        b0, b1, cb, p0, p1 = _task(t, nbc, nb, ns, grain)
        for b in range(b0, b1):
            _unrotate(gq, gqt, c, s, b, cb, hq, p0, p1, half, dq)
            _unrotate(gk, gkt, c, s, b, cb, hk, p0, p1, half, dk)


_forward = kernel(_forward_body, ELEMENTWISE)
_backward_qk = kernel(_backward_qk_body, ELEMENTWISE)
_backward = kernel(_backward_body, ELEMENTWISE)


def _heads(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """q or k as a C-contiguous array where its memory is one, and whether that array is [b, s, h, d] (Hugging
    Face's ``view(b, s, h, d).transpose(1, 2)``): rows of either order vectorise. Any other layout is read
    through its strides, correct but slower."""
    a = array(t)
    if a.flags.c_contiguous:
        return a, False
    hf = a.transpose(0, 2, 1, 3)
    return (hf, True) if hf.flags.c_contiguous else (a, False)


def forward(tensors, attrs, config):
    q, k, c, s = tensors
    qo, ko = fake(tensors, attrs)
    launch(_forward, config["threads"], *_heads(q), *_heads(k), array(c), array(s), config["positions_per_task"],
           *_heads(qo), *_heads(ko))
    return qo, ko


def fake(tensors, attrs):
    """Outputs in the layout of their inputs where that is dense (Hugging Face's transposed views stay
    transposed, as PyTorch's element-wise ops keep them): read and written in one memory order."""
    q, k, _, _ = tensors
    return torch.empty_like(q), torch.empty_like(k)


def backward(grads, tensors, results, attrs, config, needs):
    (gq, gk), (q, k, c, s) = grads, tensors
    dq, dk = torch.empty_like(gq), torch.empty_like(gk)  # as backward_fake says
    (gqa, gqt), (gka, gkt) = _heads(gq), _heads(gk)
    dqa, dka = _heads(dq)[0], _heads(dk)[0]  # in the layout of gq and gk
    if not (needs[2] or needs[3]):  # cos and sin need no gradient (Hugging Face's): q and k were not saved
        launch(_backward_qk, config["threads"], gqa, gqt, gka, gkt, array(c), array(s),
               config["positions_per_task"], dqa, dka)
        return dq, dk, None, None
    dc, ds = empty(c.shape), empty(s.shape)  # float32 sums, rounded once to bfloat16 cos/sin
    launch(_backward, config["threads"], gqa, gqt, gka, gkt, *_heads(q), *_heads(k), array(c), array(s),
           config["positions_per_task"], dqa, dka, dc.numpy(), ds.numpy())
    return dq, dk, rounded(dc, c.dtype), rounded(ds, s.dtype)


def backward_fake(grads, tensors, attrs, needs):
    """dq and dk in the layout their output gradients come in (Hugging Face's attention gives them in its
    transposed layout, the layout of q and k: no copy either way); contiguous cos and sin gradients."""
    (gq, gk), (_, _, c, s) = grads, tensors
    if not (needs[2] or needs[3]):
        return torch.empty_like(gq), torch.empty_like(gk), None, None
    return torch.empty_like(gq), torch.empty_like(gk), c.new_empty(c.shape), s.new_empty(s.shape)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    """Any strides (transposed q/k views are read in place), one float dtype for all four."""
    return shape_problem(specs, attrs) or require(specs, {i: FLOATS for i in range(4)}, contiguous=False)


def constraint(config: dict, key: Key) -> bool:
    _, _, n, _ = key.inputs[0].shape
    tasks = key.inputs[2].shape[0] * -(-n // config["positions_per_task"])
    return config["threads"] == 1 or tasks >= config["threads"]


SERIAL_BELOW = 524_288
"""Elements of q below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_POSITIONS = register_impl(Impl(
    op=ROPE, name="cpu_positions", backend="cpu", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"threads": thread_choices(), "positions_per_task": POSITIONS},
    default={"threads": max_threads(), "positions_per_task": 8}, constraint=constraint, backward_fake=backward_fake,
    fit=fit_threads(SERIAL_BELOW),
    reads={"q": ("cos", "sin"), "k": ("cos", "sin"), "cos": ("q", "k", "cos", "sin"), "sin": ("q", "k", "cos", "sin")},
))
