"""What the gated activations ``act(gate) * up`` (SwiGLU, GeGLU) share in NKI: the activation on ScalarE and the
product on VectorE, tile by tile over [rows, columns]; backward dgate = dy * up * act'(gate), dup = dy * act(gate).

gate and up are read in place in any layout whose last dim is contiguous (``launch.strided_rows``: Phi-3's halves of
its fused ``gate_up_proj``, rows strided): each tile through an access pattern; dy, the output and the gradients are
contiguous."""

from __future__ import annotations

import math

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import run, strided_rows
from ...registry.neuron.nki import nisa, nki, nl
from .tiles import ROWS, fits_sbuf, mine, strided_row_tiles, tiles

COLS = (512, 2048)
_ITEM = {"float32": 4, "bfloat16": 2}


def _both(glead, ulead, p):
    """The row tiles of gate and up (one shape: the same rows), each tile's (first row, rows, gate's start and step,
    up's start and step)."""
    for (_, r0, n, ga, gs), (_, _, _, ua, us) in zip(strided_row_tiles(glead, p), strided_row_tiles(ulead, p)):
        yield r0, n, ga, gs, ua, us


def gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, act):
    """``act(gate) * up``, traced inside a kernel: ``act`` is an activation function token (``nl.silu``); gate and
    up: rows of f elements laid out as ``glead`` and ``ulead`` (``launch.strided_rows``)."""
    n_rows = math.prod(n for n, _ in glead)
    p = rows_per_tile
    out = nl.ndarray((n_rows, f), dtype=gate.dtype, buffer=nl.shared_hbm)
    for r0, n, ga, gs, ua, us in mine(_both(glead, ulead, p)):
        for _, c0, m in tiles(f, cols):
            g = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[0:n, 0:m], src=gate.ap(pattern=[[gs, n], [1, m]], offset=ga + c0))
            u = nl.ndarray((p, cols), dtype=up.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u[0:n, 0:m], src=up.ap(pattern=[[us, n], [1, m]], offset=ua + c0))
            s = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=s[0:n, 0:m], op=act, data=g[0:n, 0:m])
            o = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=o[0:n, 0:m], data1=s[0:n, 0:m], data2=u[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=out[r0:r0 + n, c0:c0 + m], src=o[0:n, 0:m])
    return out


def gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, act_tiles):
    """dgate = dy * up * act'(gate), dup = dy * act(gate), traced inside a kernel: ``act_tiles(g, t, n, m)`` writes
    act(g) into the float32 tile ``t`` and returns a float32 tile of act'(g) (``t`` is free again after dup); dy:
    [N, f], gate and up as ``gated_fwd`` takes them."""
    n_rows, f = dy.shape
    p = rows_per_tile
    dgate = nl.ndarray((n_rows, f), dtype=gate.dtype, buffer=nl.shared_hbm)
    dup = nl.ndarray((n_rows, f), dtype=up.dtype, buffer=nl.shared_hbm)
    for r0, n, ga, gs, ua, us in mine(_both(glead, ulead, p)):
        for _, c0, m in tiles(f, cols):
            g = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g[0:n, 0:m], src=gate.ap(pattern=[[gs, n], [1, m]], offset=ga + c0))
            u = nl.ndarray((p, cols), dtype=up.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=u[0:n, 0:m], src=up.ap(pattern=[[us, n], [1, m]], offset=ua + c0))
            gy = nl.ndarray((p, cols), dtype=dy.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=gy[0:n, 0:m], src=dy[r0:r0 + n, c0:c0 + m])
            t = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
            d = act_tiles(g, t, n, m)
            du = nl.ndarray((p, cols), dtype=up.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=du[0:n, 0:m], data1=gy[0:n, 0:m], data2=t[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=dup[r0:r0 + n, c0:c0 + m], src=du[0:n, 0:m])
            nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=u[0:n, 0:m], op=nl.multiply)
            dg = nl.ndarray((p, cols), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dg[0:n, 0:m], data1=d[0:n, 0:m], data2=gy[0:n, 0:m], op=nl.multiply)
            nisa.dma_copy(dst=dgate[r0:r0 + n, c0:c0 + m], src=dg[0:n, 0:m])
    return dgate, dup


def silu_tiles(g, t, n, m):
    """SiLU of g[0:n, 0:m] into t (ScalarE's ``silu``); a float32 tile of its derivative (``silu_dx``) returned."""
    nisa.activation(dst=t[0:n, 0:m], op=nl.silu, data=g[0:n, 0:m])
    d = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=d[0:n, 0:m], op=nl.silu_dx, data=g[0:n, 0:m])
    return d


_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def gelu_tanh_tiles(g, t, n, m):
    """GELU (tanh) of g[0:n, 0:m] into t; a float32 tile of its derivative returned. With th = tanh(sqrt(2/pi) *
    x * (1 + 0.044715 x^2)): ``0.5 x (1 + th)`` and ``0.5 (1 + th) + 0.5 sqrt(2/pi) x (1 - th^2) (1 + 3 * 0.044715
    x^2)`` (PyTorch's formula), on ScalarE (square, tanh) and VectorE."""
    g = g[0:n, 0:m]
    sq = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq[0:n, 0:m], op=nl.square, data=g)
    d = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=d[0:n, 0:m], data=sq[0:n, 0:m], op0=nl.multiply, operand0=_KAPPA, op1=nl.add,
                       operand1=1.0)
    nisa.scalar_tensor_tensor(dst=d[0:n, 0:m], data=g, op0=nl.multiply, operand0=_BETA, op1=nl.multiply,
                              operand1=d[0:n, 0:m])
    nisa.activation(dst=d[0:n, 0:m], op=nl.tanh, data=d[0:n, 0:m])  # th
    nisa.tensor_scalar(dst=t[0:n, 0:m], data=d[0:n, 0:m], op0=nl.add, operand0=1.0, op1=nl.multiply,
                       operand1=0.5)  # h = 0.5 (1 + th)
    nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=d[0:n, 0:m], op=nl.multiply)
    nisa.tensor_scalar(dst=d[0:n, 0:m], data=d[0:n, 0:m], op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=1.0)  # 1 - th^2
    nisa.tensor_scalar(dst=sq[0:n, 0:m], data=sq[0:n, 0:m], op0=nl.multiply, operand0=3.0 * _KAPPA, op1=nl.add,
                       operand1=1.0)
    nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=sq[0:n, 0:m], op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=d[0:n, 0:m], data=g, op0=nl.multiply, operand0=0.5 * _BETA, op1=nl.multiply,
                              operand1=d[0:n, 0:m])
    nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=t[0:n, 0:m], op=nl.add)  # gelu'
    nisa.tensor_tensor(dst=t[0:n, 0:m], data1=t[0:n, 0:m], data2=g, op=nl.multiply)  # gelu = h * x
    return d


@nki.jit
def silu_fwd(gate, glead, up, ulead, f, rows_per_tile, cols):
    return gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, nl.silu)


@nki.jit
def silu_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols):
    return gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, silu_tiles)


@nki.jit
def gelu_tanh_fwd(gate, glead, up, ulead, f, rows_per_tile, cols):
    return gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, nl.gelu_apprx_tanh)


@nki.jit
def gelu_tanh_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols):
    return gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, gelu_tanh_tiles)


KERNELS = {"silu": (silu_fwd, silu_bwd, nl.silu), "gelu_pytorch_tanh": (gelu_tanh_fwd, gelu_tanh_bwd,
                                                                          nl.gelu_apprx_tanh)}
"""Per activation (transformers' names): the gated forward and backward kernels, and ScalarE's function."""


def _rows(t):
    return t.reshape(-1, t.shape[-1] if t.dim() else 1)


def gated_forward(kernel, tensors, config):
    g, u = tensors
    out = run(kernel, g.device)(*strided_rows(g, u), g.shape[-1], config["rows_per_tile"], config["cols"])
    return (out.reshape(g.shape).to(g.device),)


def gated_backward(kernel, grads, tensors, config):
    (dy,), (g, u) = grads, tensors
    dg, du = run(kernel, g.device)(_rows(dy), *strided_rows(g, u), config["rows_per_tile"], config["cols"])
    return dg.reshape(g.shape).to(g.device), du.reshape(u.shape).to(u.device)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    g, u = specs
    if g.shape != u.shape or not g.shape or g.numel == 0:
        return f"shapes {list(g.shape)} and {list(u.shape)} (same non-empty shape, no broadcasting)"
    if g.dtype not in _ITEM or u.dtype != g.dtype:
        return f"dtypes {g.dtype}, {u.dtype} (supports float32 or bfloat16, the same for both)"
    if g.layout[-1] != 1 or u.layout[-1] != 1:
        return "a last dim that is not contiguous"
    return None


def gated_constraint(temporaries: int):
    """The constraint of a gated impl whose backward holds ``temporaries`` float32 tiles besides its five of the
    inputs' dtype (dy, gate, up, dup, dgate)."""
    def constraint(config: dict, key: Key) -> bool:
        shape, dtype = key.inputs[0].shape, key.inputs[0].dtype
        width = shape[-1]
        rows = 1
        for s in shape[:-1]:
            rows *= s
        if config["cols"] > max(min(COLS), width) or config["rows_per_tile"] > max(32, rows):
            return False  # tiles larger than the tensor only waste SBUF
        return fits_sbuf(config["cols"] * (5 * _ITEM[dtype] + 4 * temporaries))
    return constraint


def gated_impl(op, forward, backward, fake, temporaries: int) -> Impl:
    """The NKI impl ``nki_tiled`` of a gated op ``act(gate) * up``."""
    return register_impl(Impl(
        op=op, name="nki_tiled", backend="neuron", forward=forward, backward=backward, fake=fake, supports=supports,
        space={"rows_per_tile": ROWS, "cols": COLS}, default={"rows_per_tile": 128, "cols": 512},
        constraint=gated_constraint(temporaries),
    ))
