"""The linear layer's NKI kernels, ``y = x @ w^T (+ b)`` and its gradients: tiled products on TensorE, in the
inputs' dtype, accumulated in PSUM (float32). ``linear.nki_tiled`` runs them, and ops built of linear layers (the
gated MLP's backward) launch them too.

Forward ``y = x @ w^T (+ b)``: per tile of ``rows_per_tile`` rows of x, its rows transposed on TensorE (the
contraction dim on partitions, 128 at a time), then per block of ``cols`` output columns (one PSUM bank at most)
the products over the contraction tiles against the weight's block read transposed by a strided DMA (a weight
stored transposed, [in, out] row-major, is read as it is), the bias added by one more product of a row of ones
with it (contraction 1) into the same bank. Backward: ``dx = dy @ w`` per row tile the same way (dy transposed on
TensorE, the weight's rows as they are); ``dw = dy^T @ x`` and ``db`` (``dy^T @ 1``) per block of 128 output rows,
the rows of the call the contraction (on partitions) accumulated in one bank. The programs of an LNC launch take
disjoint row tiles (forward, dx) and output-row blocks (dw, db)."""

from __future__ import annotations

from ...registry.neuron.nki import nisa, nki, nl
from .tiles import P_MAX, mine, tiles

COLS = (128, 256, 512)
"""Output columns per PSUM pass (512 float32 columns fill a bank)."""


def transposed(src, rows, cols, p, dtype):
    """SBUF tiles [<=128, p] of src[0:rows, c0:c0 + 128]^T (src in SBUF), one per 128 columns: (c0, width, tile)."""
    out = []
    for c0 in range(0, cols, P_MAX):
        w = min(P_MAX, cols - c0)
        ps = nl.ndarray((P_MAX, p), dtype=dtype, buffer=nl.psum)  # a transpose keeps the dtype
        nisa.nc_transpose(dst=ps[0:w, 0:rows], data=src[0:rows, c0:c0 + w])
        t = nl.ndarray((P_MAX, p), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t[0:w, 0:rows], src=ps[0:w, 0:rows])
        out.append((c0, w, t))
    return out


def _ones(n, dtype):
    one = nl.ndarray((P_MAX, P_MAX), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=one, value=1.0)
    return one


@nki.jit
def linear_fwd(x, w, bias, w_transposed, with_bias, rows_per_tile, cols):
    """x [M, K]; w [N, K] row-major, or its transpose [K, N] row-major where ``w_transposed``; bias [1, N] -> y."""
    m, k = x.shape
    n = w.shape[1] if w_transposed else w.shape[0]
    p = rows_per_tile
    y = nl.ndarray((m, n), dtype=x.dtype, buffer=nl.shared_hbm)
    one = _ones(P_MAX, x.dtype)
    for _, r0, rn in mine(tiles(m, p)):
        xt = nl.ndarray((p, k), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:rn, :], src=x[r0:r0 + rn, :])
        xts = transposed(xt, rn, k, p, x.dtype)
        for o0 in range(0, n, cols):
            ow = min(cols, n - o0)
            ps = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.psum)
            for i, (k0, kk, lt) in enumerate(xts):
                wt = nl.ndarray((P_MAX, cols), dtype=w.dtype, buffer=nl.sbuf)
                if w_transposed:
                    nisa.dma_copy(dst=wt[0:kk, 0:ow], src=w[k0:k0 + kk, o0:o0 + ow])
                else:  # w[o0:o0 + ow, k0:k0 + kk]^T: the contraction dim (stride 1) on partitions
                    nisa.dma_copy(dst=wt[0:kk, 0:ow], src=w.ap(pattern=[[1, kk], [k, ow]], offset=o0 * k + k0))
                nisa.nc_matmul(dst=ps[0:rn, 0:ow], stationary=lt[0:kk, 0:rn], moving=wt[0:kk, 0:ow],
                               accumulate=i > 0)
            if with_bias:
                bt = nl.ndarray((1, cols), dtype=bias.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=bt[0:1, 0:ow], src=bias[0:1, o0:o0 + ow])
                nisa.nc_matmul(dst=ps[0:rn, 0:ow], stationary=one[0:1, 0:rn], moving=bt[0:1, 0:ow],
                               accumulate=k > 0)
            o = nl.ndarray((P_MAX, cols), dtype=x.dtype, buffer=nl.sbuf)
            if k == 0 and not with_bias:
                nisa.memset(dst=o[0:rn, 0:ow], value=0.0)
            else:
                nisa.tensor_copy(dst=o[0:rn, 0:ow], src=ps[0:rn, 0:ow])
            nisa.dma_copy(dst=y[r0:r0 + rn, o0:o0 + ow], src=o[0:rn, 0:ow])
    return y


@nki.jit
def linear_bwd(dy, x, w, w_transposed, need_x, need_w, need_b, rows_per_tile, cols):
    """dy [M, N] and the forward's x and w -> dx [M, K], dw [N, K], db [N, 1] (those not needed left unwritten)."""
    m, k = x.shape
    n = dy.shape[1]
    p = rows_per_tile
    dx = nl.ndarray((m, k), dtype=x.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((n, k), dtype=x.dtype, buffer=nl.shared_hbm)
    db = nl.ndarray((n, 1), dtype=x.dtype, buffer=nl.shared_hbm)
    if need_x:
        for _, r0, rn in mine(tiles(m, p)):
            g = nl.ndarray((p, n), dtype=dy.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[0:rn, :], src=dy[r0:r0 + rn, :])
            gts = transposed(g, rn, n, p, dy.dtype)
            for c0 in range(0, k, cols):
                cw = min(cols, k - c0)
                ps = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.psum)
                for i, (n0, nn, gt) in enumerate(gts):
                    wt = nl.ndarray((P_MAX, cols), dtype=w.dtype, buffer=nl.sbuf)
                    if w_transposed:  # w^T [K, N]: its [c0, n0] block read transposed
                        nisa.dma_copy(dst=wt[0:nn, 0:cw], src=w.ap(pattern=[[1, nn], [n, cw]], offset=c0 * n + n0))
                    else:
                        nisa.dma_copy(dst=wt[0:nn, 0:cw], src=w[n0:n0 + nn, c0:c0 + cw])
                    nisa.nc_matmul(dst=ps[0:rn, 0:cw], stationary=gt[0:nn, 0:rn], moving=wt[0:nn, 0:cw],
                                   accumulate=i > 0)
                o = nl.ndarray((P_MAX, cols), dtype=x.dtype, buffer=nl.sbuf)
                if n == 0:
                    nisa.memset(dst=o[0:rn, 0:cw], value=0.0)
                else:
                    nisa.tensor_copy(dst=o[0:rn, 0:cw], src=ps[0:rn, 0:cw])
                nisa.dma_copy(dst=dx[r0:r0 + rn, c0:c0 + cw], src=o[0:rn, 0:cw])
    if need_w or need_b:
        one = _ones(P_MAX, dy.dtype)
        for n0 in mine(range(0, n, P_MAX)):
            nn = min(P_MAX, n - n0)
            if need_w:
                for c0 in range(0, k, cols):
                    cw = min(cols, k - c0)
                    ps = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.psum)
                    for t, r0, rn in tiles(m, P_MAX):
                        g = nl.ndarray((P_MAX, P_MAX), dtype=dy.dtype, buffer=nl.sbuf)
                        nisa.dma_copy(dst=g[0:rn, 0:nn], src=dy[r0:r0 + rn, n0:n0 + nn])
                        xs = nl.ndarray((P_MAX, cols), dtype=x.dtype, buffer=nl.sbuf)
                        nisa.dma_copy(dst=xs[0:rn, 0:cw], src=x[r0:r0 + rn, c0:c0 + cw])
                        nisa.nc_matmul(dst=ps[0:nn, 0:cw], stationary=g[0:rn, 0:nn], moving=xs[0:rn, 0:cw],
                                       accumulate=t > 0)
                    o = nl.ndarray((P_MAX, cols), dtype=x.dtype, buffer=nl.sbuf)
                    if m == 0:
                        nisa.memset(dst=o[0:nn, 0:cw], value=0.0)
                    else:
                        nisa.tensor_copy(dst=o[0:nn, 0:cw], src=ps[0:nn, 0:cw])
                    nisa.dma_copy(dst=dw[n0:n0 + nn, c0:c0 + cw], src=o[0:nn, 0:cw])
            if need_b:
                ps = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.psum)
                for t, r0, rn in tiles(m, P_MAX):
                    g = nl.ndarray((P_MAX, P_MAX), dtype=dy.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=g[0:rn, 0:nn], src=dy[r0:r0 + rn, n0:n0 + nn])
                    nisa.nc_matmul(dst=ps[0:nn, 0:1], stationary=g[0:rn, 0:nn], moving=one[0:rn, 0:1],
                                   accumulate=t > 0)
                o = nl.ndarray((P_MAX, 1), dtype=x.dtype, buffer=nl.sbuf)
                if m == 0:
                    nisa.memset(dst=o[0:nn, :], value=0.0)
                else:
                    nisa.tensor_copy(dst=o[0:nn, :], src=ps[0:nn, :])
                nisa.dma_copy(dst=db[n0:n0 + nn, :], src=o[0:nn, :])
    return dx, dw, db


__all__ = ["COLS", "linear_bwd", "linear_fwd", "transposed"]
