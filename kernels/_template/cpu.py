"""squared_relu on the CPU (numba): one pass in tasks of ``block`` elements (small blocks balance the threads, large
ones stream), computed in float32 for float32 or bfloat16. nan stays nan (``relu(nan)`` is nan in PyTorch); the
gradient is 0 where x <= 0 and ``dy * (2 x)`` elsewhere (nan too), in PyTorch's order (an infinite dy where
x <= 0 gives 0)."""

from __future__ import annotations

import numpy as np
from numba import prange

from ...registry import Impl, Key, register_impl
from ...registry.cpu.runtime import ELEMENTWISE, FLOATS, array, cast_to, empty_like, f32, kernel, launch, require
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from .op import SQUARED_RELU, fake

BLOCKS = (4096, 65536)
SERIAL_BELOW = 2_097_152
"""Elements below which the default config (``on`` without a table) uses one thread: SwiGLU's, a pass of the same
cost per element, taken as it is (measure the op's own with ``benchmarks/test_threads.py``; docs/benchmarks.md)."""


def _forward_body(x, block, y):
    n = x.size
    for t in prange((n + block - 1) // block):
        lo, hi = t * block, min(n, (t + 1) * block)
        xb, yb = x[lo:hi], y[lo:hi]  # slices: the inner loop vectorises
        for i in range(hi - lo):
            v = f32(xb[i])
            r = np.float32(0.0) if v <= np.float32(0.0) else v  # nan is not <= 0: it stays nan
            yb[i] = cast_to(yb, r * r)


def _backward_body(dy, x, block, dx):
    n = x.size
    for t in prange((n + block - 1) // block):
        lo, hi = t * block, min(n, (t + 1) * block)
        gb, xb, db = dy[lo:hi], x[lo:hi], dx[lo:hi]
        for i in range(hi - lo):
            v, g = f32(xb[i]), f32(gb[i])
            db[i] = cast_to(db, np.float32(0.0) if v <= np.float32(0.0) else g * (np.float32(2.0) * v))


_FORWARD, _BACKWARD = kernel(_forward_body, ELEMENTWISE), kernel(_backward_body, ELEMENTWISE)


def forward(tensors, attrs, config):
    (x,) = tensors
    y = empty_like(x)
    launch(_FORWARD, config["threads"], array(x).reshape(-1), config["block"], array(y).reshape(-1))
    return (y,)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (x,) = grads, tensors
    dx = empty_like(x)
    launch(_BACKWARD, config["threads"], array(dy.contiguous()).reshape(-1), array(x).reshape(-1), config["block"],
           array(dx).reshape(-1))
    return (dx,)


def supports(specs, attrs) -> str | None:
    """None, or why this call takes the compiler path instead."""
    return require(specs, {0: FLOATS})


def constraint(config: dict, key: Key) -> bool:
    """Configs worth timing at this key: enough tasks for the threads, no blocks larger than the tensor."""
    n = key.inputs[0].numel
    if config["threads"] > 1 and -(-n // config["block"]) < config["threads"]:
        return False
    return config["block"] == min(BLOCKS) or config["block"] <= n


CPU_BLOCKS = register_impl(Impl(
    op=SQUARED_RELU, name="cpu_blocks", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"threads": thread_choices(), "block": BLOCKS},  # what the tuner searches
    default={"threads": max_threads(), "block": 65536}, constraint=constraint, fit=fit_threads(SERIAL_BELOW),
    reads={"x": ("x",)},  # the gradient reads x only: the output is not saved
))
