"""The gated MLP in NKI, ``gated_mlp.nki_fused``.

Forward, one kernel: per tile of ``rows_per_tile`` tokens, x's rows transposed on TensorE (hidden on partitions, 128
at a time), then per block of 128 intermediate columns the gate and up products into two PSUM tiles (the weights'
blocks read transposed by strided DMAs; a fused ``gate_up`` weight's up rows start I rows in), the activation on
ScalarE and the product on VectorE, the block transposed (intermediate on partitions) and multiplied with the down
weight's block into the token tile's output, summed over blocks in a float32 SBUF tile. No [tokens, I] tensor is
written to HBM. Backward, launches of the pack's own kernels: gate and up made again (``shared/linear_nki.py``), the
activation and its gradient (``shared/gated_nki.py``), the down product's gradients, then one product's gradients
of gate and up where the weight is fused (their gradients side by side), else each's (x's gradient their sum).
"""

from __future__ import annotations

import math

import torch

from ...registry import Impl, Key, register_impl
from ...registry.neuron.launch import run, strided_rows
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.gated_nki import KERNELS
from ..shared.linear_nki import linear_bwd, linear_fwd, transposed
from ..shared.tiles import P_MAX, ROWS, fits_sbuf, mine, tiles
from .op import GATED_MLP, dtype_problem, fake, shape_problem

OUT_COLS = 512
"""Output columns per PSUM pass of the down product (a bank of float32)."""
_ITEM = {"float32": 4, "bfloat16": 2}
_TILES = {"rows_per_tile": 128, "cols": 512}
"""The backward's launches: the linear and gated kernels' own defaults."""


def _block_t(w, r0, rn, c0, cn, stride, dst):
    """dst[0:cn, 0:rn] = w[r0:r0 + rn, c0:c0 + cn]^T of a row-major HBM weight of row ``stride``: the contraction dim
    (stride 1) on partitions."""
    nisa.dma_copy(dst=dst[0:cn, 0:rn], src=w.ap(pattern=[[1, cn], [stride, rn]], offset=r0 * stride + c0))


@nki.jit
def mlp_fwd(x, gate, up, down, fused, act, rows_per_tile):
    """x [M, H]; gate [I, H] (fused: [2I, H], gate rows first; ``up`` unread), up [I, H], down [O, I], all
    row-major -> y [M, O]."""
    m, h = x.shape
    inter = gate.shape[0] // 2 if fused else gate.shape[0]
    o = down.shape[0]
    p = rows_per_tile
    up_w, up_at = (gate, inter) if fused else (up, 0)
    y = nl.ndarray((m, o), dtype=x.dtype, buffer=nl.shared_hbm)
    for _, r0, rn in mine(tiles(m, p)):
        xt = nl.ndarray((p, h), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:rn, :], src=x[r0:r0 + rn, :])
        xts = transposed(xt, rn, h, p, x.dtype)
        acc = nl.ndarray((p, o), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc[0:rn, :], value=0.0)
        for i0 in range(0, inter, P_MAX):
            iw = min(P_MAX, inter - i0)
            halves = []
            for w, at in ((gate, 0), (up_w, up_at)):
                ps = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.psum)
                for j, (k0, kk, lt) in enumerate(xts):
                    wt = nl.ndarray((P_MAX, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
                    _block_t(w, at + i0, iw, k0, kk, h, wt)
                    nisa.nc_matmul(dst=ps[0:rn, 0:iw], stationary=lt[0:kk, 0:rn], moving=wt[0:kk, 0:iw],
                                   accumulate=j > 0)
                sb = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=sb[0:rn, 0:iw], src=ps[0:rn, 0:iw])
                halves.append(sb)
            g, u = halves
            nisa.activation(dst=g[0:rn, 0:iw], op=act, data=g[0:rn, 0:iw])
            hb = nl.ndarray((P_MAX, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=hb[0:rn, 0:iw], data1=g[0:rn, 0:iw], data2=u[0:rn, 0:iw], op=nl.multiply)
            ((_, _, ht),) = transposed(hb, rn, iw, p, x.dtype)
            for o0 in range(0, o, OUT_COLS):
                ow = min(OUT_COLS, o - o0)
                wd = nl.ndarray((P_MAX, OUT_COLS), dtype=x.dtype, buffer=nl.sbuf)
                _block_t(down, o0, ow, i0, iw, inter, wd)
                ps = nl.ndarray((P_MAX, OUT_COLS), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=ps[0:rn, 0:ow], stationary=ht[0:iw, 0:rn], moving=wd[0:iw, 0:ow])
                nisa.tensor_tensor(dst=acc[0:rn, o0:o0 + ow], data1=acc[0:rn, o0:o0 + ow], data2=ps[0:rn, 0:ow],
                                   op=nl.add)
        out = nl.ndarray((p, o), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out[0:rn, :], src=acc[0:rn, :])
        nisa.dma_copy(dst=y[r0:r0 + rn, :], src=out[0:rn, :])
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def forward(tensors, attrs, config):
    x, gw, uw, dw = (None if t is None else t.detach() for t in tensors)
    fused = uw is None
    y = run(mlp_fwd, x.device)(_rows(x), gw.contiguous(), (gw if fused else uw).contiguous(), dw.contiguous(),
                               fused, KERNELS[attrs["act"]][2], config["rows_per_tile"])
    return (y.to(x.device).view(*x.shape[:-1], dw.shape[0]),)


def _product(x2, w):
    """x2 @ w^T on the linear kernel (row-major w, no bias)."""
    return run(linear_fwd, x2.device)(x2, w, x2.new_zeros((1, 1)), False, False, _TILES["rows_per_tile"],
                                      _TILES["cols"]).to(x2.device)


def _grads(dy, x2, w, need_w):
    """dy @ w and, where needed, dy^T @ x2: the linear kernel's backward."""
    dx, dwt, _ = run(linear_bwd, dy.device)(dy.contiguous(), x2, w, False, True, need_w, False,
                                             _TILES["rows_per_tile"], _TILES["cols"])
    return dx.to(dy.device), (dwt.to(dy.device) if need_w else None)


def backward(grads, tensors, results, attrs, config, needs):
    (g,), (x, gw, uw, dw) = grads, (None if t is None else t.detach() for t in tensors)
    need_x, need_g, need_u, need_d = needs
    fwd_k, bwd_k, _ = KERNELS[attrs["act"]]
    x2, dy = _rows(x), _rows(g)
    gw, dw = gw.contiguous(), dw.contiguous()
    fused = uw is None
    if fused:
        gate, up = _product(x2, gw).chunk(2, dim=-1)
    else:
        uw = uw.contiguous()
        gate, up = _product(x2, gw), _product(x2, uw)
    inter = gate.shape[-1]
    h = run(fwd_k, x.device)(*strided_rows(gate, up), inter, _TILES["rows_per_tile"], _TILES["cols"]).to(x.device)
    dh, d_down = _grads(dy, h, dw, need_d)
    dg, du = (t.to(x.device) for t in run(bwd_k, x.device)(dh, *strided_rows(gate, up), _TILES["rows_per_tile"],
                                                              _TILES["cols"]))
    if fused:
        dx, d_gate = _grads(torch.cat((dg, du), dim=-1), x2, gw, need_g)
        d_up = None
    else:
        dx, d_gate = _grads(dg, x2, gw, need_g)
        dx_u, d_up = _grads(du, x2, uw, need_u)
        dx = dx + dx_u
    return (dx.view(x.shape) if need_x else None), d_gate, d_up, d_down


def supports(specs, attrs) -> str | None:
    why = shape_problem(specs, attrs) or dtype_problem(specs)
    if why:
        return why
    x, _, _, d = specs
    if math.prod(x.shape[:-1]) == 0 or x.shape[-1] == 0 or 0 in d.shape:
        return "no tokens, hidden size, intermediate or output columns"
    return None


def constraint(config: dict, key: Key) -> bool:
    """A token tile of x, its transpose, the float32 sum of its output and the blocks fit a partition; no tile of
    more tokens than the call's."""
    x, _, _, d = key.inputs
    rows, h, o = math.prod(x.shape[:-1]), x.shape[-1], d.shape[0]
    p, item = config["rows_per_tile"], _ITEM[x.dtype]
    if p > max(min(ROWS), rows):
        return False
    return fits_sbuf(item * (h + p * -(-h // P_MAX) + o + 2 * P_MAX + OUT_COLS) + 4 * (o + 2 * P_MAX))


NKI_FUSED = register_impl(Impl(
    op=GATED_MLP, name="nki_fused", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS}, default={"rows_per_tile": 128}, constraint=constraint,
    reads={n: ("x", "gate_weight", "up_weight", "down_weight") for n in GATED_MLP.differentiable},
    examples=(  # partial token tiles, three intermediate blocks (the last partial), two output blocks
        ((((130, 200), "float32"), ((600, 200), "float32"), None, ((600, 300), "float32")), {}),
        ((((2, 70, 130), "bfloat16"), ((300, 130), "bfloat16"), ((300, 130), "bfloat16"),
          ((520, 300), "bfloat16")), {"act": "gelu_pytorch_tanh"}),
    ),
))
