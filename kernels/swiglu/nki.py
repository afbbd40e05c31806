"""SwiGLU in NKI: silu on ScalarE and the product on VectorE, tile by tile over [rows, columns].
Backward: dgate = dy * up * silu'(gate), dup = dy * silu(gate)."""

from __future__ import annotations

from ...registry import Impl, Key, TensorSpec, register_impl
from ..nki import nisa, nki, nl
from ..nki.launch import run
from ..nki.tiles import ROWS, fits_sbuf, mine, tiles
from .op import SWIGLU, fake

COLS = (512, 2048)
_ITEM = {"float32": 4, "bfloat16": 2}


@nki.jit
def swiglu_fwd(gate, up, rows_per_tile, cols):
    n_rows, f = gate.shape
    p = rows_per_tile
    out = nl.ndarray((n_rows, f), dtype=gate.dtype, buffer=nl.shared_hbm)
    for _, r0, n in mine(tiles(n_rows, p)):
        for _, c0, m in tiles(f, cols):
            g = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[0:n, 0:m], src=gate[r0:r0 + n, c0:c0 + m])
            u = nl.ndarray((p, cols), dtype=up.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u[0:n, 0:m], src=up[r0:r0 + n, c0:c0 + m])
            s = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=s[0:n, 0:m], op=nl.silu, data=g[0:n, 0:m])
            o = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=o[0:n, 0:m], data1=s[0:n, 0:m], data2=u[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=out[r0:r0 + n, c0:c0 + m], src=o[0:n, 0:m])
    return out


@nki.jit
def swiglu_bwd(dy, gate, up, rows_per_tile, cols):
    n_rows, f = gate.shape
    p = rows_per_tile
    dgate = nl.ndarray((n_rows, f), dtype=gate.dtype, buffer=nl.shared_hbm)
    dup = nl.ndarray((n_rows, f), dtype=up.dtype, buffer=nl.shared_hbm)
    for _, r0, n in mine(tiles(n_rows, p)):
        for _, c0, m in tiles(f, cols):
            g = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[0:n, 0:m], src=gate[r0:r0 + n, c0:c0 + m])
            u = nl.ndarray((p, cols), dtype=up.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u[0:n, 0:m], src=up[r0:r0 + n, c0:c0 + m])
            gy = nl.ndarray((p, cols), dtype=dy.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=gy[0:n, 0:m], src=dy[r0:r0 + n, c0:c0 + m])
            t = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=t[0:n, 0:m], op=nl.silu, data=g[0:n, 0:m])
            du = nl.ndarray((p, cols), dtype=up.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=du[0:n, 0:m], data1=gy[0:n, 0:m], data2=t[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=dup[r0:r0 + n, c0:c0 + m], src=du[0:n, 0:m])
            nisa.activation(dst=t[0:n, 0:m], op=nl.silu_dx, data=g[0:n, 0:m])
            nisa.tensor_tensor(dst=t[0:n, 0:m], data1=t[0:n, 0:m], data2=u[0:n, 0:m], op=nl.multiply)
            dg = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dg[0:n, 0:m], data1=t[0:n, 0:m], data2=gy[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=dgate[r0:r0 + n, c0:c0 + m], src=dg[0:n, 0:m])
    return dgate, dup


def _rows(t):
    return t.reshape(-1, t.shape[-1] if t.dim() else 1)


def forward(tensors, attrs, config):
    g, u = tensors
    out = run(swiglu_fwd, g.device)(_rows(g), _rows(u), config["rows_per_tile"], config["cols"])
    return (out.reshape(g.shape).to(g.device),)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (g, u) = grads, tensors
    dg, du = run(swiglu_bwd, g.device)(_rows(dy), _rows(g), _rows(u), config["rows_per_tile"], config["cols"])
    return dg.reshape(g.shape).to(g.device), du.reshape(u.shape).to(u.device)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    g, u = specs
    if g.shape != u.shape or not g.shape or g.numel == 0:
        return f"shapes {list(g.shape)} and {list(u.shape)} (same non-empty shape, no broadcasting)"
    if g.dtype not in _ITEM or u.dtype != g.dtype or not (g.is_contiguous and u.is_contiguous):
        return f"dtypes {g.dtype}, {u.dtype} (supports contiguous float32 or bfloat16, the same for both)"
    return None


def constraint(config: dict, key: Key) -> bool:
    shape, dtype = key.inputs[0].shape, key.inputs[0].dtype
    width = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    if config["cols"] > max(min(COLS), width) or config["rows_per_tile"] > max(32, rows):
        return False  # tiles larger than the tensor only waste SBUF
    return fits_sbuf(config["cols"] * (4 * _ITEM[dtype] + 8))


NKI_TILED = register_impl(Impl(
    op=SWIGLU, name="nki_tiled", backend="neuron", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"rows_per_tile": ROWS, "cols": COLS}, default={"rows_per_tile": 128, "cols": 512}, constraint=constraint,
))
