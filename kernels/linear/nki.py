"""The linear layer in NKI, ``linear.nki_tiled``: the tiled products of ``shared/linear_nki.py`` (forward, and the
input, weight and bias gradients), a weight read as it is stored (row-major, or the transpose of a row-major
[in, out]), x's rows made contiguous."""

from __future__ import annotations

import math

import torch

from ...registry import Impl, Key, register_impl
from ...registry.neuron.launch import run
from ..shared.linear_nki import COLS, linear_bwd, linear_fwd
from ..shared.tiles import P_MAX, ROWS, fits_sbuf
from .op import LINEAR, fake, shape_problem

_ITEM = {"float32": 4, "bfloat16": 2}


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _weight(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The weight as the kernels read it: row-major [out, in], or its row-major transpose [in, out]."""
    if w.is_contiguous():
        return w, False
    if w.t().is_contiguous():
        return w.t(), True
    return w.contiguous(), False


def forward(tensors, attrs, config):
    x, w, b = tensors
    wk, transposed = _weight(w.detach())
    bias = (b.detach() if b is not None else x.new_zeros(1)).reshape(1, -1)
    y = run(linear_fwd, x.device)(_rows(x.detach()), wk, bias, transposed,
                                  b is not None, config["rows_per_tile"], config["cols"])
    return (y.to(x.device).view(*x.shape[:-1], w.shape[0]),)


def backward(grads, tensors, results, attrs, config, needs):
    (g,), (x, w, _) = grads, tensors  # x where the weight's gradient is needed, w where x's is
    dy = _rows(g)
    m, n = dy.shape
    k = w.shape[-1] if w is not None else x.shape[-1] if x is not None else 1  # neither: only db is needed
    wk, transposed = _weight(w.detach()) if w is not None else (dy.new_empty((n, k)), False)  # unread
    xk = _rows(x.detach()) if x is not None else dy.new_empty((m, k))  # unread
    dx, dw, db = run(linear_bwd, g.device)(dy, xk, wk, transposed, needs[0], needs[1], needs[2],
                                           config["rows_per_tile"], config["cols"])
    dev = g.device
    return (dx.to(dev).view(*g.shape[:-1], k) if needs[0] else None, dw.to(dev) if needs[1] else None,
            db.to(dev).view(-1) if needs[2] else None)


def supports(specs, attrs) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    x, w, b = specs
    if x.dtype not in _ITEM or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return "dtypes other than one of float32 or bfloat16 for all"
    if math.prod(x.shape[:-1]) == 0 or w.shape[0] == 0:
        return "no rows or no output columns"
    return None


def constraint(config: dict, key: Key) -> bool:
    """A row tile of x and of dy fits a partition, with their transposes and a block of the weight; no tiles or
    column blocks wider than the call."""
    x, w = key.inputs[0], key.inputs[1]
    k, n = x.shape[-1], w.shape[0]
    rows = math.prod(x.shape[:-1])
    item = _ITEM[x.dtype]
    if config["rows_per_tile"] > max(min(ROWS), rows) or config["cols"] > max(min(COLS), n, k):
        return False
    tiles_k, tiles_n = -(-k // P_MAX), -(-n // P_MAX)
    return fits_sbuf(item * (k + n + config["rows_per_tile"] * (tiles_k + tiles_n) + 3 * config["cols"] + P_MAX))


NKI_TILED = register_impl(Impl(
    op=LINEAR, name="nki_tiled", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS, "cols": COLS}, default={"rows_per_tile": 128, "cols": 512},
    constraint=constraint, reads={"x": ("weight",), "weight": ("x",), "bias": ()},
))
