"""squared_relu in NKI: relu on ScalarE and the square on VectorE, tile by tile over [rows, columns] of the input
(its leading dims collapsed into rows); backward ``dx = (2 relu(x)) * dy``, 0 where x <= 0."""

from __future__ import annotations

from ...registry import Impl, Key, register_impl
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.tiles import ROWS, fits_sbuf, mine, tiles
from .op import SQUARED_RELU, fake

COLS = (512, 2048)
_ITEM = {"float32": 4, "bfloat16": 2}


@nki.jit
def squared_relu_fwd(x, rows_per_tile, cols):
    n_rows, f = x.shape
    p = rows_per_tile
    y = nl.ndarray((n_rows, f), dtype=x.dtype, buffer=nl.shared_hbm)
    for _, r0, n in mine(tiles(n_rows, p)):
        for _, c0, m in tiles(f, cols):
            t = nl.ndarray((p, cols), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[0:n, 0:m], src=x[r0:r0 + n, c0:c0 + m])
            r = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=r[0:n, 0:m], op=nl.relu, data=t[0:n, 0:m])
            o = nl.ndarray((p, cols), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=o[0:n, 0:m], data1=r[0:n, 0:m], data2=r[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=y[r0:r0 + n, c0:c0 + m], src=o[0:n, 0:m])
    return y


@nki.jit
def squared_relu_bwd(dy, x, rows_per_tile, cols):
    n_rows, f = x.shape
    p = rows_per_tile
    dx = nl.ndarray((n_rows, f), dtype=x.dtype, buffer=nl.shared_hbm)
    for _, r0, n in mine(tiles(n_rows, p)):
        for _, c0, m in tiles(f, cols):
            t = nl.ndarray((p, cols), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t[0:n, 0:m], src=x[r0:r0 + n, c0:c0 + m])
            g = nl.ndarray((p, cols), dtype=dy.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[0:n, 0:m], src=dy[r0:r0 + n, c0:c0 + m])
            r = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=r[0:n, 0:m], op=nl.relu, data=t[0:n, 0:m])
            d = nl.ndarray((p, cols), dtype=x.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=d[0:n, 0:m], data=r[0:n, 0:m], op0=nl.multiply, operand0=2.0,
                                      op1=nl.multiply, operand1=g[0:n, 0:m])
            nisa.dma_copy(dst=dx[r0:r0 + n, c0:c0 + m], src=d[0:n, 0:m])
    return dx


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def forward(tensors, attrs, config):
    (x,) = tensors
    y = run(squared_relu_fwd, x.device)(_rows(x), config["rows_per_tile"], config["cols"])
    return (y.reshape(x.shape).to(x.device),)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (x,) = grads, tensors
    dx = run(squared_relu_bwd, x.device)(_rows(dy.contiguous()), _rows(x), config["rows_per_tile"], config["cols"])
    return (dx.reshape(x.shape).to(x.device),)


def supports(specs, attrs) -> str | None:
    (x,) = specs
    if not x.shape or x.numel == 0:
        return f"shape {list(x.shape)} (supports a non-empty tensor of at least one dim)"
    if x.dtype not in _ITEM:
        return f"dtype {x.dtype} (supports float32 or bfloat16)"
    if not x.is_contiguous:
        return "a non-contiguous input"
    return None


def constraint(config: dict, key: Key) -> bool:
    """No tiles larger than the tensor (they only waste SBUF); the backward's four tiles fit a partition."""
    shape, dtype = key.inputs[0].shape, key.inputs[0].dtype
    rows = key.inputs[0].numel // shape[-1] if shape[-1] else 0
    if config["cols"] > max(min(COLS), shape[-1]) or config["rows_per_tile"] > max(min(ROWS), rows):
        return False
    return fits_sbuf(config["cols"] * (3 * _ITEM[dtype] + 4))


NKI_TILED = register_impl(Impl(
    op=SQUARED_RELU, name="nki_tiled", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS, "cols": COLS}, default={"rows_per_tile": 128, "cols": 512},
    constraint=constraint, reads={"x": ("x",)},
))
