"""Attention on the CPU (numba): tiled flash attention with an online softmax, parallel over (batch, head).

Forward: each task takes ``block_q`` query rows of one head and walks the keys ``block_k`` at a time: the tile's
scores by a BLAS matrix product (numba's ``np.dot``, float32), the mask or the causal triangle, the running max
and sum of exponentials rescaled where the max rises, and the tile's probabilities times v added to the output.
Tiles the causal triangle or a boolean mask masks whole are skipped, forward and backward (PyTorch's flash
attention skips the causal ones only).
It keeps each query row's log-sum-exp (float32) for the backward; the [sq, sk] probabilities never exist whole.
Backward: one task per (batch, query head) recomputes each tile's probabilities from the log-sum-exp, and
accumulates dv += p^T do, ds = p * (do v^T - rowsum(do * o)), dq += ds k, dk += ds^T q (scaled) in float32; the
k and v gradients of the heads of a group are summed after the kernel (GQA).
q, k, v are read in any layout (Hugging Face passes transposed views) and converted tile by tile to float32;
float32 or bfloat16 (computed in float32, rounded once). A query row whose keys are all masked gives 0 and
gradients 0, as PyTorch's SDPA does (torch 2.5 and later, CPU math and flash alike); nan and inf in the inputs
spread as in the expression's softmax.
"""

from __future__ import annotations

import ctypes
import glob
import os
from contextlib import contextmanager

import numpy as np
import scipy
import torch
from numba import prange
from numba import types as nbtypes
from numba.extending import overload

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import (
    FASTMATH,
    FLOATS,
    array,
    cast_to,
    empty,
    exp32,
    f32,
    fmax32,
    helper,
    kernel,
    launch,
    require,
    rounded,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from .op import ATTENTION, fake, shape_problem

BLOCKS_Q = (32, 64, 128, 256)
BLOCKS_K = (64, 128, 256, 512)
_NEG = np.float32(-np.inf)


def masked(row, j, s):
    """Score ``s`` under ``row[j]``, one row of the mask: s + -inf where a boolean mask is False (-inf, or nan for a
    nan or +inf score, as SDPA's own arithmetic gives), else s plus the additive mask."""
    raise NotImplementedError("masked runs only inside numba kernels")


@overload(masked, inline="always", jit_options=dict(fastmath=FASTMATH, error_model="numpy"))
def _masked(row, j, s):
    if row.dtype == nbtypes.boolean:
        return lambda row, j, s: s if row[j] else s + _NEG
    return lambda row, j, s: s + f32(row[j])


@helper(FASTMATH)
def _rows(x, b, h, r0, r1, mul):
    """x[b, h, r0:r1, :] * mul as a new float32 [rows, dim] array."""
    d = x.shape[3]
    t = np.empty((r1 - r0, d), np.float32)
    for i in range(r1 - r0):
        for c in range(d):
            t[i, c] = f32(x[b, h, r0 + i, c]) * mul
    return t


@helper(FASTMATH)
def _cols(x, b, h, r0, r1):
    """x[b, h, r0:r1, :] transposed, as a new float32 [dim, rows] array."""
    d = x.shape[3]
    t = np.empty((d, r1 - r0), np.float32)
    for i in range(r1 - r0):
        for c in range(d):
            t[c, i] = f32(x[b, h, r0 + i, c])
    return t


def unmasked(row, j):
    """Whether ``row[j]``, one row of the mask, lets the key through: True for a boolean mask's True, and for any
    additive value (an additive tile is never skipped, so a nan score spreads as in the expression)."""
    raise NotImplementedError("unmasked runs only inside numba kernels")


@overload(unmasked, inline="always", jit_options=dict(fastmath=FASTMATH, error_model="numpy"))
def _unmasked(row, j):
    if row.dtype == nbtypes.boolean:
        return lambda row, j: row[j]
    return lambda row, j: True


@helper(FASTMATH)
def _skipped(mask, skip, b, h, i0, i1, j0, j1):
    """Whether a boolean mask masks every key of tile [i0, i1) x [j0, j1): its scores, probabilities and
    gradients are then not computed (they add nothing: exp(-inf) = 0). A padding mask with the causal triangle,
    as Hugging Face passes, masks about half the tiles of a long sequence. ``skip`` is 0 where the inputs hold
    inf or nan: a masked nan score or inf value still spreads nan in the expression."""
    if not skip:
        return False
    for i in range(i0, i1):
        row = mask[b, h, i]
        for j in range(j0, j1):
            if unmasked(row, j):
                return False
    return True


@helper(FASTMATH)
def _mask_tile(s, mask, kind, causal, b, h, i0, j0):
    """The mask (``kind`` 1) and the causal triangle (key j after query i) on the scores of tile (i0, j0)."""
    rows, cols = s.shape
    if kind:
        for i in range(rows):
            row = mask[b, h, i0 + i, j0:j0 + cols]
            for j in range(cols):
                s[i, j] = masked(row, j, s[i, j])
    if causal and j0 + cols - 1 > i0:
        for i in range(rows):
            for j in range(max(0, i0 + i + 1 - j0), cols):
                s[i, j] = _NEG


@helper(FASTMATH)
def _row_max(s, i):
    m = _NEG
    for j in range(s.shape[1]):
        m = fmax32(m, s[i, j])
    return m


@helper(FASTMATH)
def _exp_row(s, i, m):
    """s[i] = exp(s[i] - m), returning its sum."""
    t = np.float32(0.0)
    for j in range(s.shape[1]):
        p = exp32(s[i, j] - m)
        s[i, j] = p
        t += p
    return t


def _forward_body(q, k, v, mask, kind, skip, causal, scale, bq, bk, out, lse):
    nb, hq, n, _ = q.shape
    hk, m, ev = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hk
    nqb = (n + bq - 1) // bq
    for t in prange(nb * hq * nqb):
        b, h, i0 = t // (hq * nqb), (t // nqb) % hq, (t % nqb) * bq
        i1, g = min(n, i0 + bq), (t // nqb) % hq // group
        rows = i1 - i0
        qt = _rows(q, b, h, i0, i1, scale)
        acc = np.zeros((rows, ev), np.float32)
        mx = np.full(rows, _NEG, np.float32)
        total = np.zeros(rows, np.float32)
        end = min(m, i1) if causal else m
        for j0 in range(0, end, bk):
            j1 = min(end, j0 + bk)
            if _skipped(mask, skip, b, h, i0, i1, j0, j1):
                continue
            s = np.dot(qt, _cols(k, b, g, j0, j1))
            _mask_tile(s, mask, kind, causal, b, h, i0, j0)
            for i in range(rows):
                top = fmax32(mx[i], _row_max(s, i))
                if top == _NEG:  # every key so far masked: nothing to add
                    for j in range(j1 - j0):
                        s[i, j] = 0.0
                    continue
                alpha = exp32(mx[i] - top)
                total[i] = total[i] * alpha + _exp_row(s, i, top)
                mx[i] = top
                if alpha != 1.0:
                    for c in range(ev):
                        acc[i, c] *= alpha
            acc += np.dot(s, _rows(v, b, g, j0, j1, np.float32(1.0)))
        for i in range(rows):
            if mx[i] == _NEG:  # a fully masked row: 0, and a log-sum-exp that makes its probabilities 0
                for c in range(ev):
                    out[b, h, i0 + i, c] = cast_to(out, np.float32(0.0))
                lse[b, h, i0 + i] = np.inf
                continue
            inv = np.float32(1.0) / total[i]
            for c in range(ev):
                out[b, h, i0 + i, c] = cast_to(out, acc[i, c] * inv)
            lse[b, h, i0 + i] = mx[i] + np.log(total[i])


def _backward_body(do, q, k, v, o, lse, mask, kind, skip, causal, scale, bq, bk, dq, dk, dv):
    nb, hq, n, e = q.shape
    hk, m, ev = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hk
    for t in prange(nb * hq):
        b, h = t // hq, t % hq
        g = h // group
        qs = _rows(q, b, h, 0, n, scale)
        dos = _rows(do, b, h, 0, n, np.float32(1.0))
        delta = np.empty(n, np.float32)  # rowsum(do * o)
        for i in range(n):
            a = np.float32(0.0)
            for c in range(ev):
                a += dos[i, c] * f32(o[b, h, i, c])
            delta[i] = a
        dqa = np.zeros((n, e), np.float32)
        for j0 in range(0, m, bk):
            j1 = min(m, j0 + bk)
            kb = _rows(k, b, g, j0, j1, np.float32(1.0))
            kc = _cols(k, b, g, j0, j1)
            vc = _cols(v, b, g, j0, j1)
            dka = np.zeros((j1 - j0, e), np.float32)
            dva = np.zeros((j1 - j0, ev), np.float32)
            for i0 in range((j0 // bq) * bq if causal else 0, n, bq):
                i1 = min(n, i0 + bq)
                if _skipped(mask, skip, b, h, i0, i1, j0, j1):
                    continue
                s = np.dot(qs[i0:i1], kc)
                _mask_tile(s, mask, kind, causal, b, h, i0, j0)
                for i in range(i1 - i0):
                    z = lse[b, h, i0 + i]
                    for j in range(j1 - j0):
                        s[i, j] = exp32(s[i, j] - z)
                dva += np.dot(s.T, dos[i0:i1])
                dp = np.dot(dos[i0:i1], vc)
                for i in range(i1 - i0):
                    di = delta[i0 + i]
                    for j in range(j1 - j0):
                        dp[i, j] = s[i, j] * (dp[i, j] - di)
                dqa[i0:i1] += np.dot(dp, kb)
                dka += np.dot(dp.T, qs[i0:i1])
            for j in range(j1 - j0):
                for c in range(e):
                    dk[b, h, j0 + j, c] = dka[j, c]
                for c in range(ev):
                    dv[b, h, j0 + j, c] = dva[j, c]
        for i in range(n):
            for c in range(e):
                dq[b, h, i, c] = dqa[i, c] * scale


_forward = kernel(_forward_body)
_backward = kernel(_backward_body)



def _blas_threads() -> tuple | None:
    """(get, set) of the thread count of the OpenBLAS that numba's ``np.dot`` calls (scipy's), where found."""
    libs = os.path.join(os.path.dirname(os.path.dirname(scipy.__file__)), "scipy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas*.so"))):
        lib = ctypes.CDLL(path)
        get, put = (getattr(lib, f"scipy_openblas_{n}_num_threads", None) for n in ("get", "set"))
        if get is not None and put is not None:
            put.argtypes = [ctypes.c_int]
            return get, put
    return None


_BLAS = _blas_threads()


@contextmanager
def one_blas_thread():
    """BLAS on one thread while the kernel's own threads call it: OpenBLAS would otherwise start its threads for
    each tile above 64^3 inside numba's OpenMP loop (oversubscribed, and OpenBLAS warns it may hang)."""
    if _BLAS is None:
        yield
        return
    before = _BLAS[0]()
    if before != 1:
        _BLAS[1](1)
    try:
        yield
    finally:
        if before != 1:
            _BLAS[1](before)


_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def _scale(q: torch.Tensor, attrs: dict) -> np.float32:
    s = attrs["scale"]
    return np.float32(1.0 / np.sqrt(q.shape[-1]) if s is None else s)


def _mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, *data: torch.Tensor) -> tuple:
    """The mask broadcast to [b, hq, sq, sk] (a view: broadcast dims have stride 0), whether there is one, and
    whether tiles it masks whole may be skipped (a boolean mask, and every value of ``data`` finite)."""
    full = (*q.shape[:3], k.shape[2])
    if mask is None:  # a stand-in of the boolean masks' type (writable, strided): no compile of its own
        return array(_NO_MASK.expand(full)), 0, 0
    skip = mask.dtype == torch.bool and all(bool(torch.isfinite(t).all()) for t in data)
    return array(mask.expand(full)), 1, int(skip)


def forward(tensors, attrs, config):
    q, k, v, mask = tensors
    out, lse = fake(tensors, attrs)
    if out.numel():
        with one_blas_thread():
            launch(_forward, config["threads"], array(q), array(k), array(v), *_mask(mask, q, k, q, k, v),
                   attrs["causal"], _scale(q, attrs), config["block_q"], config["block_k"], array(out), lse.numpy())
    return out, lse


def backward(grads, tensors, results, attrs, config, needs):
    (do,), (q, k, v, mask), (o, lse) = grads, tensors, results
    b, hq, n, e = q.shape
    hk, m, ev = k.shape[1], k.shape[2], v.shape[3]
    dq = empty((b, hq, n, e))
    dk = empty((b, hq, m, e))
    dv = empty((b, hq, m, ev))
    if q.numel() and k.numel():
        with one_blas_thread():
            launch(_backward, config["threads"], array(do), array(q), array(k), array(v), array(o), lse.numpy(),
                   *_mask(mask, q, k, do, q, k, v), attrs["causal"], _scale(q, attrs), config["block_q"],
                   config["block_k"], dq.numpy(), dk.numpy(), dv.numpy())
    else:
        for t in (dq, dk, dv):
            t.zero_()
    if hq != hk:  # the heads of a group share k and v: their gradients add up
        dk = dk.view(b, hk, hq // hk, m, e).sum(2)
        dv = dv.view(b, hk, hq // hk, m, ev).sum(2)
    return rounded(dq, q.dtype), rounded(dk, k.dtype), rounded(dv, v.dtype), None


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    return shape_problem(specs, attrs) or require(specs[:3], {0: FLOATS}, contiguous=False)


def constraint(config: dict, key: Key) -> bool:
    q, k = key.inputs[0].shape, key.inputs[1].shape
    tasks = q[0] * q[1]
    return ((config["threads"] == 1 or tasks >= config["threads"])
            and config["block_q"] <= max(BLOCKS_Q[0], q[2]) and config["block_k"] <= max(BLOCKS_K[0], k[2]))


SERIAL_BELOW = 32_768
"""Elements of q below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_FLASH = register_impl(Impl(
    op=ATTENTION, name="cpu_flash", backend="cpu", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"threads": thread_choices(), "block_q": BLOCKS_Q, "block_k": BLOCKS_K},
    default={"threads": max_threads(), "block_q": 64, "block_k": 128}, constraint=constraint, saved=1,
    fit=fit_threads(SERIAL_BELOW),
    reads={"q": ("q", "k", "v", "mask", "result_0", "result_1"), "k": ("q", "k", "v", "mask", "result_0", "result_1"),
           "v": ("q", "k", "v", "mask", "result_0", "result_1"), "mask": ()},
))
