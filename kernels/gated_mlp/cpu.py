"""The gated MLP on the CPU, a tile of tokens at a time: each tile's gate and up products, its activation (the
numba pass SwiGLU and GeGLU run, ``shared/gated_cpu.py``) and its down product. Two impls: ``cpu_tiled`` keeps
nothing for the backward beyond the inputs, so no [tokens, inter] tensor outlives a tile: it makes each tile's
gate and up again (two products beside the nine a step's MLP makes, or one where gate and up are one fused weight),
where the compiled graph keeps both for every token; ``cpu_kept`` keeps them, as the compiled graph does. Each
pass's products run on a tuned library (``fwd`` the forward's and the recomputed ones, ``dgrad`` the input
gradients', ``wgrad`` the weights'; ``shared/products.py``), on a tuned number of threads; the weights' gradients
accumulate over tiles in float32."""

from __future__ import annotations

import math

import torch

from ...registry import Impl, Key, register_impl
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices, torch_threads
from ..shared.gated_cpu import GELU_TANH, SILU, gated_backward, gated_forward
from ..shared.products import ONEDNN, accumulate, allowed, onednn_enabled, product
from .op import GATED_MLP, dtype_problem, fake, shape_problem

KERNELS = {"silu": SILU, "gelu_pytorch_tanh": GELU_TANH}
PASSES = ("fwd", "dgrad", "wgrad")
TILES = (64, 128, 256, 512, 1024, 4096)
"""Tokens per tile: small ones keep a tile's intermediates in cache, large ones make fewer, larger products."""
_BLOCK = 16384  # the activation's elements per task (its own default)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _weights(gate_weight: torch.Tensor, up_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's and up's weights: the halves of a fused one as views."""
    if up_weight is None:
        return gate_weight.chunk(2, dim=0)
    return gate_weight, up_weight


def _gate_up(xt, gate_weight, up_weight, onednn: bool, out: tuple | None = None):
    """One tile's gate and up: one product for a fused weight (its halves views of it), else two; into ``out``'s
    rows where the forward keeps them."""
    if up_weight is None:
        return product(xt, gate_weight, onednn, out=None if out is None else out[0]).chunk(2, dim=-1)
    if out is None:
        return product(xt, gate_weight, onednn), product(xt, up_weight, onednn)
    return product(xt, gate_weight, onednn, out=out[0]), product(xt, up_weight, onednn, out=out[1])


def _kept(x2: torch.Tensor, gw: torch.Tensor, uw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``cpu_kept``'s forward keeps: gate and up of every token ([tokens, 2I] and an empty one where they are
    the halves of one fused product)."""
    n = x2.shape[0]
    return x2.new_empty((n, gw.shape[0])), x2.new_empty((n, 0 if uw is None else uw.shape[0]))


def _forward(tensors, attrs, config, keep: bool) -> tuple:
    x, gw, uw, dw = (None if t is None else t.detach() for t in tensors)
    kernels, act = KERNELS[attrs["act"]], {"threads": config["threads"], "block": _BLOCK}
    x2, fwd = _rows(x), onednn_enabled(config["fwd"])
    y = torch.empty((x2.shape[0], dw.shape[0]), dtype=x.dtype)
    kept = _kept(x2, gw, uw) if keep else ()
    with torch_threads(config["threads"]):
        for lo in range(0, x2.shape[0], config["tile"]):
            hi = lo + config["tile"]
            gu = _gate_up(x2[lo:hi], gw, uw, fwd, tuple(k[lo:hi] for k in kept) if keep else None)
            (h,) = gated_forward(kernels, gu, act)
            product(h, dw, fwd, out=y[lo:hi])
    return (y.view(*x.shape[:-1], dw.shape[0]), *kept)


def forward(tensors, attrs, config):
    return _forward(tensors, attrs, config, keep=False)


def forward_keeping(tensors, attrs, config, needs):
    """``cpu_kept``'s forward: gate and up kept for the backward where the call trains, none in inference."""
    out = _forward(tensors, attrs, config, keep=any(needs))
    return out if any(needs) else (*out, tensors[0].new_empty(0), tensors[0].new_empty(0))


def fake_keeping(tensors, attrs, needs):
    x, gw, uw, _ = tensors
    kept = _kept(_rows(x), gw, uw) if any(needs) else (x.new_empty(0), x.new_empty(0))
    return (*fake(tensors, attrs), *kept)


def backward(grads, tensors, results, attrs, config, needs):
    """Per tile: gate and up (kept, or made again), the activation's gradient from ``dy @ down``, then each
    gradient's products."""
    (dy,), (x, gw, uw, dw) = grads, (None if t is None else t.detach() for t in tensors)
    kept = results[1:] if len(results) > 1 and results[1] is not None else None
    need_x, need_g, need_u, need_d = needs
    kernels, act = KERNELS[attrs["act"]], {"threads": config["threads"], "block": _BLOCK}
    fwd, dgrad, wgrad = (onednn_enabled(config[p]) for p in PASSES)
    x2, dy2, (wg, wu) = _rows(x), _rows(dy), _weights(gw, uw)
    dx = torch.empty(x2.shape, dtype=x.dtype) if need_x else None
    acc_g = acc_u = acc_d = None  # float32 sums over tiles of each weight's gradient
    n_in, n_gate = x2.shape[1], wg.shape[0]
    # a fused weight's gradient: both halves summed in place in one tensor (no concatenation after)
    fused = torch.empty((2 * n_gate, n_in)) if uw is None and need_g else None
    halves = (None, None) if fused is None else (fused[:n_gate], fused[n_gate:])
    with torch_threads(config["threads"]):
        for lo in range(0, x2.shape[0], config["tile"]):
            hi = lo + config["tile"]
            xt, dyt = x2[lo:hi], dy2[lo:hi]
            if kept is None:
                g, u = _gate_up(xt, gw, uw, fwd)
            else:
                g, u = kept[0][lo:hi].chunk(2, dim=-1) if uw is None else (kept[0][lo:hi], kept[1][lo:hi])
            if need_d:
                (h,) = gated_forward(kernels, (g, u), act)
                acc_d = accumulate(acc_d, dyt.t(), h.t(), wgrad)
                del h
            if not (need_x or need_g or need_u):
                continue
            # a tile's own gate and up take their gradients in place; kept ones stay (a second backward reads them)
            dg, du = gated_backward(kernels, (product(dyt, dw.t(), dgrad),), (g, u), act,
                                    out=(g, u) if kept is None else None)
            if need_x:
                product(dg, wg.t(), dgrad, out=dx[lo:hi])
                accumulate(dx[lo:hi], du, wu.t(), dgrad)
            if need_g:
                acc_g = accumulate(acc_g, dg.t(), xt.t(), wgrad, into=halves[0])
            if need_u or fused is not None:
                acc_u = accumulate(acc_u, du.t(), xt.t(), wgrad, into=halves[1])
            del g, u, dg, du  # before the next tile's are made: one tile's intermediates live at a time

    def done(acc, shape, dtype):  # an empty call (no tiles) has a gradient of zeros
        return torch.zeros(shape, dtype=dtype) if acc is None else acc.to(dtype)

    if fused is not None:
        d_gate, d_up = (fused.zero_() if acc_g is None else fused).to(gw.dtype), None
    else:
        d_gate = done(acc_g, gw.shape, gw.dtype) if need_g else None
        d_up = done(acc_u, uw.shape, uw.dtype) if need_u else None
    d_down = done(acc_d, dw.shape, dw.dtype) if need_d else None
    return (None if dx is None else dx.view(x.shape)), d_gate, d_up, d_down


def supports(specs, attrs) -> str | None:
    """Any layout of x and the weights (products take them as they are stored); float32 or bfloat16, one dtype."""
    return shape_problem(specs, attrs) or dtype_problem(specs)


def _tokens(key: Key) -> int:
    return math.prod(key.inputs[0].shape[:-1])


def _work(key: Key) -> int:
    """Multiply-adds of the forward: tokens x inter x (hidden x 2 + out)."""
    x, g, _, d = key.inputs
    return _tokens(key) * d.shape[1] * (2 * x.shape[-1] + d.shape[0])


def constraint(config: dict, key: Key) -> bool:
    """oneDNN's products only where they run the key's dtype here; tiles up to the first that holds every token."""
    smaller = [t for t in TILES if t < config["tile"]]
    return allowed(config, PASSES, key.inputs[0].dtype) and (not smaller or smaller[-1] < _tokens(key))


SERIAL_BELOW = 1 << 20
"""Multiply-adds below which the default config runs on one thread (as linear's products)."""

_SPACE = {"threads": thread_choices(), "tile": TILES, **{p: (0, 1) for p in PASSES}}
_DEFAULT = {"threads": max_threads(), "tile": 256, "fwd": int(ONEDNN), "dgrad": 0, "wgrad": 0}
_INPUTS = ("x", "gate_weight", "up_weight", "down_weight")

CPU_TILED = register_impl(Impl(
    op=GATED_MLP, name="cpu_tiled", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space=_SPACE, default=_DEFAULT, constraint=constraint, backward_params=("dgrad", "wgrad"),
    fit=fit_threads(SERIAL_BELOW, _work), reads={n: _INPUTS for n in GATED_MLP.differentiable},
))
"""Keeps nothing but the inputs: each tile's gate and up made again in the backward."""

CPU_KEPT = register_impl(Impl(
    op=GATED_MLP, name="cpu_kept", backend="cpu", forward=forward_keeping, backward=backward, fake=fake_keeping,
    supports=supports, space=_SPACE, default=_DEFAULT, constraint=constraint, backward_params=("dgrad", "wgrad"),
    fit=fit_threads(SERIAL_BELOW, _work), saved=2, forward_needs=True,
    reads={n: (*_INPUTS, "result_1", "result_2") for n in GATED_MLP.differentiable},
))
"""Keeps gate and up of every token, as the compiled graph does (its memory, two products fewer): the products'
libraries and the fused activation are what it changes."""
