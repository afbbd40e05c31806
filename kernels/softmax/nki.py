"""Softmax over the last dim in NKI: rows on partitions; -rowmax by tensor_reduce, exp with that bias and
the row sum through the ScalarE accumulator in one activation, then a reciprocal and one scaling.
Backward: dx = y * (dy - sum(dy * y)), with dy shifted by its value at the peak (some y above one half),
exact because sum(y) = 1: a peaked row then does not compute its largest gradient as 1 - y_peak."""

from __future__ import annotations

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.tiles import ROWS, fits_sbuf, mine, tiles
from .op import SOFTMAX, dim_problem, fake

_ITEM = {"float32": 4, "bfloat16": 2}


@nki.jit
def softmax_fwd(x, rows_per_tile):
    n_rows, d = x.shape
    p = rows_per_tile
    y = nl.ndarray((n_rows, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for _, r0, n in mine(tiles(n_rows, p)):
        xt = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:n, :], src=x[r0:r0 + n, :])
        nmx = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=nmx[0:n, :], op=nl.maximum, data=xt[0:n, :], axis=1, negate=True)
        e = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e[0:n, :], op=nl.exp, data=xt[0:n, :], bias=nmx[0:n, :], reduce_op=nl.add,
                        reduce_res=s[0:n, :], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.reciprocal(dst=s[0:n, :], data=s[0:n, :])
        yt = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=yt[0:n, :], data=e[0:n, :], op0=nl.multiply, operand0=s[0:n, :])
        nisa.dma_copy(dst=y[r0:r0 + n, :], src=yt[0:n, :])
    return y


@nki.jit
def softmax_bwd(dy, y, rows_per_tile):
    n_rows, d = y.shape
    p = rows_per_tile
    dx = nl.ndarray((n_rows, d), dtype=y.dtype, buffer=nl.shared_hbm)
    for _, r0, n in mine(tiles(n_rows, p)):
        gt = nl.ndarray((p, d), dtype=dy.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=gt[0:n, :], src=dy[r0:r0 + n, :])
        yt = nl.ndarray((p, d), dtype=y.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=yt[0:n, :], src=y[r0:r0 + n, :])
        work = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
        low = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
        c, a, b = (nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(3))
        # c = dy at the peak (the entry with y above one half, if any)
        nisa.scalar_tensor_tensor(dst=work[0:n, :], data=yt[0:n, :], op0=nl.greater, operand0=0.5,
                                  op1=nl.multiply, operand1=gt[0:n, :])
        nisa.tensor_reduce(dst=c[0:n, :], op=nl.add, data=work[0:n, :], axis=1)
        # b = sum(y), a = sum(y * dy), both over the other entries
        nisa.scalar_tensor_tensor(dst=low[0:n, :], data=yt[0:n, :], op0=nl.less_equal, operand0=0.5,
                                  op1=nl.multiply, operand1=yt[0:n, :])
        nisa.tensor_reduce(dst=b[0:n, :], op=nl.add, data=low[0:n, :], axis=1)
        nisa.tensor_tensor(dst=work[0:n, :], data1=low[0:n, :], data2=gt[0:n, :], op=nl.multiply)
        nisa.tensor_reduce(dst=a[0:n, :], op=nl.add, data=work[0:n, :], axis=1)
        # acc = sum(y * (dy - c)) = a - c * b; dx = y * ((dy - c) - acc)
        nisa.scalar_tensor_tensor(dst=b[0:n, :], data=b[0:n, :], op0=nl.multiply, operand0=c[0:n, :],
                                  op1=nl.subtract, operand1=a[0:n, :], reverse1=True)
        nisa.tensor_scalar(dst=work[0:n, :], data=gt[0:n, :], op0=nl.subtract, operand0=c[0:n, :],
                           op1=nl.subtract, operand1=b[0:n, :])
        dxt = nl.ndarray((p, d), dtype=y.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dxt[0:n, :], data1=work[0:n, :], data2=yt[0:n, :], op=nl.multiply)
        nisa.dma_copy(dst=dx[r0:r0 + n, :], src=dxt[0:n, :])
    return dx


def forward(tensors, attrs, config):
    (x,) = tensors
    d = x.shape[-1]
    return (run(softmax_fwd, x.device)(x.reshape(-1, d), config["rows_per_tile"]).reshape(x.shape).to(x.device),)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (y,) = grads, results
    d = y.shape[-1]
    dx = run(softmax_bwd, y.device)(dy.reshape(-1, d), y.reshape(-1, d), config["rows_per_tile"])
    return (dx.reshape(y.shape).to(y.device),)


def sbuf_bytes(d: int, dtype: str) -> int:
    return d * (3 * _ITEM[dtype] + 8) + 16  # forward: x, exp, y; backward: dy, y, two float32 work rows, dx


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    (x,) = specs
    if x.dtype not in _ITEM or not x.shape or x.numel == 0 or not x.is_contiguous:
        return f"x {x.dtype} {list(x.shape)} (supports contiguous float32 or bfloat16)"
    why = dim_problem(specs, attrs)
    if why:
        return why
    if not fits_sbuf(sbuf_bytes(x.shape[-1], x.dtype)):
        return f"rows of {x.shape[-1]} (a row must fit one partition of SBUF)"
    return None


def constraint(config: dict, key: Key) -> bool:
    shape = key.inputs[0].shape
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return config["rows_per_tile"] <= max(32, rows)


NKI_ROWS = register_impl(Impl(
    op=SOFTMAX, name="nki_rows", backend="neuron", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"rows_per_tile": ROWS}, default={"rows_per_tile": 128}, constraint=constraint,
))
