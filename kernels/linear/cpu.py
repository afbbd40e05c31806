"""The linear layer on the CPU: each pass's product on the library that is faster at the site, a tuned choice per
pass (``fwd``, ``dgrad`` the input's gradient, ``wgrad`` the weight's): torch's BLAS (``mm``/``addmm``, MKL on
x86, what the compiled graph calls) or oneDNN's linear (``shared/products.py``), on a tuned number of torch's
threads. Which is faster differs by shape and by pass (docs/benchmarks.md, "Linear layers"): no fixed choice is
right, so the tuner makes it per site.

Operands as the passes take them without copies: the forward's weight as it is stored (row-major, or the
transpose of a row-major [in, out]; oneDNN takes both), the input gradient's weight as its transpose (oneDNN's
column-major weight), the weight gradient ``dy^T @ x`` with ``x^T`` as oneDNN's weight (its input, ``dy^T``, copied
row-major once, as torch does for oneDNN). The bias gradient is the output gradient's column sums. Nothing is saved
beyond the inputs the gradients read (x for the weight's, the weight for x's), as the compiled graph saves."""

from __future__ import annotations

import math

import torch

from ...registry import Impl, Key, register_impl
from ...registry.cpu.runtime import FLOATS
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices, torch_threads
from ..shared.products import ONEDNN, allowed, onednn_enabled, product
from .op import LINEAR, fake, shape_problem

PASSES = ("fwd", "dgrad", "wgrad")
"""Per pass, 1 for oneDNN's product, 0 for torch's."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., d] as [rows, d] (a view where the leading dims collapse)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def forward(tensors, attrs, config):
    x, w, b = tensors
    with torch_threads(config["threads"]):
        y = product(_rows(x.detach()), w.detach(), onednn_enabled(config["fwd"]),
                    None if b is None else b.detach())
    return (y.view(*x.shape[:-1], w.shape[0]),)


def backward(grads, tensors, results, attrs, config, needs):
    (g,), (x, w, _) = grads, tensors  # x where the weight's gradient is needed, w where x's is
    need_x, need_w, need_b = needs
    dy = _rows(g)
    dx = dw = db = None
    with torch_threads(config["threads"]):
        if need_x:
            dx = product(dy, w.detach().t(), onednn_enabled(config["dgrad"])).view(*g.shape[:-1], w.shape[1])
        if need_w:
            dw = product(dy.t(), _rows(x.detach()).t(), onednn_enabled(config["wgrad"]))
        if need_b:
            db = dy.sum(0)
    return dx, dw, db


def supports(specs, attrs) -> str | None:
    """Any layout of x (its rows made contiguous where they are not, as torch does) and of the weight; float32 or
    bfloat16, one dtype for all."""
    why = shape_problem(specs, attrs)
    if why:
        return why
    x, w, b = specs
    if x.dtype not in FLOATS or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return (f"x {x.dtype}, weight {w.dtype}{'' if b is None else f', bias {b.dtype}'} (supports one of "
                f"{', '.join(FLOATS)} for all)")
    return None


def _work(key: Key) -> int:
    """Multiply-adds of the forward: rows x in x out."""
    x, w = key.inputs[0], key.inputs[1]
    return x.numel * w.shape[0]


def constraint(config: dict, key: Key) -> bool:
    """oneDNN's products only where they run the key's dtype here."""
    return allowed(config, PASSES, key.inputs[0].dtype)


SERIAL_BELOW = 1 << 20
"""Multiply-adds below which the default config runs the products on one thread (a product of a few hundred
thousand multiply-adds takes tens of microseconds: a second thread's start costs as much)."""

CPU_PRODUCTS = register_impl(Impl(
    op=LINEAR, name="cpu_products", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"threads": thread_choices(), **{p: (0, 1) for p in PASSES}},
    default={"threads": max_threads(), "fwd": int(ONEDNN), "dgrad": int(ONEDNN), "wgrad": 0},
    constraint=constraint, backward_params=("dgrad", "wgrad"), fit=fit_threads(SERIAL_BELOW, _work),
    reads={"x": ("weight",), "weight": ("x",), "bias": ()},
))
