"""GeGLU on the CPU (numba): SwiGLU's loops (``swiglu.cpu.gated_kernels``) with the tanh-approximated GELU.

PyTorch's formulas, in its order: ``gelu(x) = 0.5 x (1 + t)``, ``t = tanh(sqrt(2/pi) (x + 0.044715 x^3))``, and
``gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)``, with a float32 tanh that
vectorises (``_cpu.tanh32``: numba here has no SVML, and a libm call per element would not vectorise). So the
products saturate where PyTorch's do (t rounds to -1 below x of about -5.3: gelu is -0 and its derivative 0 there,
so an infinite ``up`` or output gradient gives nan as in PyTorch), and inf and nan land where they land in PyTorch
(gelu(-inf) is nan, as ``-inf * 0``; the derivative is nan where ``x^2`` overflows, as ``0 * inf``).
"""

from __future__ import annotations

import numpy as np

from .._cpu import inline, tanh32
from ..swiglu.cpu import gated_backward, gated_forward, gated_impl, gated_kernels
from ..swiglu.op import fake
from .op import GEGLU

_BETA = np.float32(0.7978845608028654)  # sqrt(2 / pi), as PyTorch's M_SQRT2 * M_2_SQRTPI * 0.5
_KAPPA = np.float32(0.044715)


@inline
def gelu_tanh(x):
    t = tanh32(_BETA * (x + _KAPPA * (x * x * x)))
    return np.float32(0.5) * x * (np.float32(1.0) + t)


@inline
def gelu_tanh_grad(x):
    x2 = x * x
    t = tanh32(_BETA * (x + _KAPPA * (x2 * x)))
    left, right = np.float32(0.5) * x, np.float32(1.0) + t
    dleft = np.float32(0.5) * right
    dright = left * (np.float32(1.0) - t * t) * (_BETA * (np.float32(1.0) + np.float32(3.0) * _KAPPA * x2))
    return left * right, dleft + dright


_KERNELS = gated_kernels(gelu_tanh, gelu_tanh_grad)


def forward(tensors, attrs, config):
    return gated_forward(_KERNELS, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(_KERNELS, grads, tensors, config)


SERIAL_BELOW = 32_768
"""Elements of gate below which the default config (what ``on`` runs where no table names a config) uses one
thread: from this size up a second thread paid in both modes, on this project's 2-core machine, quiet
(``.venv/bin/python -m pytest benchmarks/test_threads.py -s -p no:randomly``; one / two threads, medians of 15
interleaved rounds; at 32768 elements (128 x 256): forward 29.7 / 24.7 us, forward+backward 108.8 / 100.2 us). Its
tanh makes each element dearer than SwiGLU's, whose second thread paid at no size up to 2097152."""

CPU_FUSED = gated_impl(GEGLU, forward, backward, fake, serial_below=SERIAL_BELOW)
