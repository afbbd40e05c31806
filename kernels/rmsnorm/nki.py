"""RMSNorm in NKI (current ``nki`` API): rows tiled over the partitions, forward and backward.

Forward, per tile of ``rows_per_tile`` rows: the sum of squares through the ScalarE
accumulator, chunk by chunk (``activation(square)`` with ``reduce_cmd`` reset then
reduce), rstd = rsqrt(sum / D + eps), and y = x * rstd * w in one
``scalar_tensor_tensor``. The weight is broadcast to every partition once, by a
ones-vector matmul (TensorE is the engine that moves data across partitions), and the offset
added to it there in float32 (Gemma's ``1 + weight``); no weight is a weight of ones.

Backward: dx = rstd * (dy * w) - x * rstd^3 * mean(dy * w * x) per row, and
dweight = sum over rows of dy * x * rstd, a partition reduction done as a matmul
with a ones column, accumulated across row tiles either in PSUM (one bank per
``chunk`` columns) or in an SBUF row.

The programs of an LNC launch take disjoint row tiles; each writes its partial
dweight to its own row of a [programs, D] output, summed on the host.

x is read in place in any layout whose last dim is contiguous: the kernels take the span of its memory as one flat
HBM tensor and its leading dims as (size, stride) pairs (``lead``), and load each tile of rows by an access pattern
whose partition step is the innermost leading dim's stride (a tile stays within that dim). So Hugging Face's
per-head q/k (``view(b, s, h, d).transpose(1, 2)``, rows that no single stride spans) need no copy. y, rstd, dy and
dx are contiguous, rows in x's row-major order.
"""

from __future__ import annotations

import math

import torch

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import run, strided_rows
from ...registry.neuron.limits import limits_target
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.tiles import mine, strided_row_tiles
from .op import RMSNORM, fake, scale, shape_problem

ROWS_PER_TILE = (32, 64, 128)
CHUNK = (128, 256, 512)
_ITEM = {"float32": 4, "bfloat16": 2}


def _broadcast_row(vec, d, p, chunk, offset=0.0):
    """vec (HBM, [d]) + offset in every one of p partitions, as float32 SBUF [p, d]."""
    ones = nl.ndarray((1, p), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    row = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=vec.reshape((1, d)))
    out = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
    for c in range((d + chunk - 1) // chunk):
        c0 = c * chunk
        m = min(chunk, d - c0)
        ps = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[:, 0:m], stationary=ones, moving=row[:, c0:c0 + m], is_stationary_onezero=True,
                       accumulate=False)
        nisa.tensor_copy(dst=out[:, c0:c0 + m], src=ps[:, 0:m])
    if offset != 0.0:
        nisa.tensor_scalar(dst=out, data=out, op0=nl.add, operand0=offset)
    return out


@nki.jit
def rmsnorm_fwd(x, lead, d, w, eps, offset, rows_per_tile, chunk):
    """x: HBM, rows of d elements laid out as ``lead``; w: HBM [D] -> y = x * rstd * (w + offset) [N, D] (x's
    dtype), rstd [N, 1] float32."""
    n_rows = math.prod(n for n, _ in lead)
    p = rows_per_tile
    y = nl.ndarray((n_rows, d), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    w_b = _broadcast_row(w, d, p, chunk, offset)
    n_chunks = (d + chunk - 1) // chunk
    for _, r0, n, at, step in mine(strided_row_tiles(lead, p)):
        xt = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:n, :], src=x.ap(pattern=[[step, n], [1, d]], offset=at))
        sq = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0 = c * chunk
            m = min(chunk, d - c0)
            last = c == n_chunks - 1
            nisa.activation(dst=sq[0:n, 0:m], op=nl.square, data=xt[0:n, c0:c0 + m], reduce_op=nl.add,
                            reduce_res=ss[0:n, :] if last else None,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce if c == 0 else nisa.reduce_cmd.reduce)
        rs = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rs[0:n, :], data=ss[0:n, :], op0=nl.multiply, operand0=1.0 / d,
                           op1=nl.add, operand1=eps)
        nisa.activation(dst=rs[0:n, :], op=nl.rsqrt, data=rs[0:n, :])
        yt = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=yt[0:n, :], data=xt[0:n, :], op0=nl.multiply, operand0=rs[0:n, :],
                                  op1=nl.multiply, operand1=w_b[0:n, :])
        nisa.dma_copy(dst=y[r0:r0 + n, :], src=yt[0:n, :])
        nisa.dma_copy(dst=rstd[r0:r0 + n, :], src=rs[0:n, :])
    return y, rstd


@nki.jit
def rmsnorm_bwd(dy, x, lead, w, offset, rstd, rows_per_tile, chunk, dw_in_psum):
    """dy: HBM [N, D]; x: rows laid out as ``lead`` (as rmsnorm_fwd's); w: [D] (the scale w + offset); rstd: [N, 1]
    float32 -> dx [N, D], dw [programs, D] float32 (one partial sum per program of the launch)."""
    n_rows, d = dy.shape
    p = rows_per_tile
    dx = nl.ndarray((n_rows, d), dtype=x.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((nl.num_programs(), d), dtype=nl.float32, buffer=nl.shared_hbm)
    w_b = _broadcast_row(w, d, p, chunk, offset)
    ones = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    n_chunks = (d + chunk - 1) // chunk
    acc_ps = [nl.ndarray((1, chunk), dtype=nl.float32, buffer=nl.psum) for _ in range(n_chunks if dw_in_psum else 0)]
    acc_sb = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc_sb, value=0.0)  # a program may own no row tile: its partial is zero
    owned = 0  # row tiles this program took (tiles stay within a head: there may be more than rows / p)
    for t, (_, r0, n, at, step) in enumerate(mine(strided_row_tiles(lead, p))):
        owned += 1
        dyt = nl.ndarray((p, d), dtype=dy.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=dyt[0:n, :], src=dy[r0:r0 + n, :])
        xt = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:n, :], src=x.ap(pattern=[[step, n], [1, d]], offset=at))
        rs = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rs[0:n, :], src=rstd[r0:r0 + n, :])
        g = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)  # dy * (w + offset)
        nisa.tensor_tensor(dst=g[0:n, :], data1=dyt[0:n, :], data2=w_b[0:n, :], op=nl.multiply)
        tmp = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=tmp[0:n, :], data1=g[0:n, :], data2=xt[0:n, :], op=nl.multiply)
        s = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s[0:n, :], op=nl.add, data=tmp[0:n, :], axis=1)
        r3 = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r3[0:n, :], data1=rs[0:n, :], data2=rs[0:n, :], op=nl.multiply)
        nisa.tensor_tensor(dst=r3[0:n, :], data1=r3[0:n, :], data2=rs[0:n, :], op=nl.multiply)
        c = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # rstd^3 * mean(dy * w * x)
        nisa.scalar_tensor_tensor(dst=c[0:n, :], data=s[0:n, :], op0=nl.multiply, operand0=1.0 / d,
                                  op1=nl.multiply, operand1=r3[0:n, :])
        nisa.tensor_scalar(dst=tmp[0:n, :], data=xt[0:n, :], op0=nl.multiply, operand0=c[0:n, :])
        dxt = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=dxt[0:n, :], data=g[0:n, :], op0=nl.multiply, operand0=rs[0:n, :],
                                  op1=nl.subtract, operand1=tmp[0:n, :])
        nisa.dma_copy(dst=dx[r0:r0 + n, :], src=dxt[0:n, :])
        # dweight: sum over the rows (partitions) of dy * x * rstd, as ones[n, 1].T @ h[n, cols]
        nisa.scalar_tensor_tensor(dst=g[0:n, :], data=dyt[0:n, :], op0=nl.multiply, operand0=rs[0:n, :],
                                  op1=nl.multiply, operand1=xt[0:n, :])
        for ci in range(n_chunks):
            c0 = ci * chunk
            m = min(chunk, d - c0)
            if dw_in_psum:
                nisa.nc_matmul(dst=acc_ps[ci][:, 0:m], stationary=ones[0:n, :], moving=g[0:n, c0:c0 + m],
                               accumulate=t > 0)
            else:
                ps = nl.ndarray((1, chunk), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=ps[:, 0:m], stationary=ones[0:n, :], moving=g[0:n, c0:c0 + m], accumulate=False)
                nisa.tensor_tensor(dst=acc_sb[:, c0:c0 + m], data1=acc_sb[:, c0:c0 + m], data2=ps[:, 0:m],
                                   op=nl.add)
    if dw_in_psum and owned:  # the program accumulated at least one tile
        for ci in range(n_chunks):
            c0 = ci * chunk
            m = min(chunk, d - c0)
            nisa.tensor_copy(dst=acc_sb[:, c0:c0 + m], src=acc_ps[ci][:, 0:m])
    nisa.dma_copy(dst=dw[nl.program_id(0):nl.program_id(0) + 1, :], src=acc_sb)
    return dx, dw


# -- the impl ------------------------------------------------------------------------------------------------------


def forward(tensors: tuple, attrs: dict, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = tensors
    w, offset = scale(x, w, attrs)
    d = x.shape[-1]
    y, rstd = run(rmsnorm_fwd, x.device)(*strided_rows(x), d, w, attrs["eps"], offset, config["rows_per_tile"],
                                         config["chunk"])
    return y.reshape(x.shape).to(x.device), rstd.reshape(x.shape[:-1]).to(x.device)


def backward(grads: tuple, tensors: tuple, results: tuple, attrs: dict, config: dict, needs: tuple) -> tuple:
    (dy,), (x, w0), (_, rstd) = grads, tensors, results
    w, offset = scale(x, w0, attrs)
    d = x.shape[-1]
    dx, dw = run(rmsnorm_bwd, x.device)(dy.reshape(-1, d), *strided_rows(x), w, offset, rstd.reshape(-1, 1),
                                        config["rows_per_tile"], config["chunk"], config["dw_in_psum"])
    return dx.reshape(x.shape).to(x.device), (None if w0 is None else dw.sum(0).to(w.dtype).to(x.device))


def sbuf_bytes(d: int, dtype: str, config: dict, training: bool) -> int:
    """Bytes per partition of the live SBUF tiles (the kernels above, tile by tile)."""
    s, p, chunk = _ITEM[dtype], config["rows_per_tile"], config["chunk"]
    broadcast = 4 * p + 4 * d + 4 * d  # ones, the weight row, the broadcast weight
    if not training:
        return broadcast + 2 * d * s + 4 * chunk + 8
    return broadcast + 4 + 4 * d + 3 * d * s + 8 * d + 16  # ones, dw row, dy/x/dx tiles, g and tmp, columns


def psum_banks(d: int, config: dict, training: bool) -> int:
    if training and config["dw_in_psum"]:
        return -(-d // config["chunk"])
    return 1  # the weight broadcast's bank, released after each chunk's copy


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    x, w = specs
    wdtype = x.dtype if w is None else w.dtype
    if x.dtype not in _ITEM or wdtype != x.dtype:
        return f"dtypes {x.dtype}, {wdtype} (supports float32 or bfloat16, the same for both)"
    why = shape_problem(specs, attrs)
    if why:
        return why
    if x.numel == 0:
        return "empty x"
    if x.layout[-1] != 1 or (w is not None and not w.is_contiguous):
        return "a last dim of x that is not contiguous, or a non-contiguous weight"
    d = x.shape[-1]
    smallest = {"rows_per_tile": min(ROWS_PER_TILE), "chunk": min(CHUNK), "dw_in_psum": 0}
    if sbuf_bytes(d, x.dtype, smallest, training=True) > limits_target().sbuf_partition_bytes:
        return f"width {d} (its tiles do not fit the SBUF of {limits_target().name})"
    return None


def constraint(config: dict, key: Key) -> bool:
    """The hardware limits: SBUF bytes per partition, PSUM banks, the matmul's moving size."""
    xs, dtype = key.inputs[0].shape, key.inputs[0].dtype
    d, t = xs[-1], limits_target()
    training = key.mode == "training"
    if config["chunk"] > t.matmul_n_fp32 or config["chunk"] * 4 > t.psum_bank_bytes:
        return False
    if sbuf_bytes(d, dtype, config, training) > t.sbuf_partition_bytes:
        return False
    if psum_banks(d, config, training) > t.psum_partition_bytes // t.psum_bank_bytes:
        return False
    rows = math.prod(xs[:-1]) if len(xs) > 1 else 1
    smallest_cover = min((r for r in ROWS_PER_TILE if r >= rows), default=max(ROWS_PER_TILE))
    return config["rows_per_tile"] <= smallest_cover  # taller tiles than the rows only waste SBUF


NKI_TILED = register_impl(Impl(
    op=RMSNORM,
    name="nki_tiled",
    backend="neuron",
    forward=forward,
    backward=backward,
    fake=fake,
    supports=supports,
    space={"rows_per_tile": ROWS_PER_TILE, "chunk": CHUNK, "dw_in_psum": (0, 1)},
    default={"rows_per_tile": 128, "chunk": 512, "dw_in_psum": 0},
    constraint=constraint,
    backward_params=("dw_in_psum",),
    saved=1,
))
