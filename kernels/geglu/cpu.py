"""GeGLU on the CPU (numba): the gated pass (``shared/gated_cpu.py``) with the tanh-approximated GELU.

PyTorch's function, ``gelu(x) = 0.5 x (1 + t)`` with ``t = tanh(z)``, ``z = sqrt(2/pi) (x + 0.044715 x^3)``, and
its derivative ``0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)``, taken through the logistic
``s = 0.5 (1 + t) = 1 / (1 + exp(-2z))``: with ``h = e / (1 + e)``, ``e = exp(-2|z|)``, ``s`` is ``1 - h`` or
``h`` by the sign of z and ``1 - t^2 = 4 h (1 - h)``. ``1 + t`` written out cancels in float32 once z is below
about -1 (at x = -3 it keeps one digit in four); ``h`` does not, so the kernel is as close to float64 as PyTorch's
float32 or closer. It saturates where PyTorch does: ``h`` is 0 where t rounded to float32 is ±1 (x below about
-5.3: gelu is -0 and its derivative 0, so an infinite ``up`` or output gradient gives nan as in PyTorch), and inf
and nan land where they land in PyTorch (gelu(-inf) is nan, as ``-inf * 0``; the derivative is nan at ±inf and
where ``x^2`` overflows, as ``0 * inf``). One
``registry.cpu.runtime.exp32`` per element, which vectorises (numba here has no SVML, and a libm call per element
would not vectorise).
"""

from __future__ import annotations

import numpy as np

from ...registry.cpu.runtime import exp32, inline
from ..shared.gated import fake
from ..shared.gated_cpu import gated_backward, gated_forward, gated_impl, gated_kernels
from .op import GEGLU

_BETA = np.float32(0.7978845608028654)  # sqrt(2 / pi), as PyTorch's M_SQRT2 * M_2_SQRTPI * 0.5
_KAPPA = np.float32(0.044715)
_ROUNDS = np.float32(2.0**-26)  # h = (1 - |t|) / 2 below which t, rounded to float32, is ±1


@inline
def _halves(x, x2):
    """(s, h (1 - h)): the logistic of 2z and the derivative's factor, without cancellation."""
    z = _BETA * (x + _KAPPA * (x2 * x))
    e = exp32(np.float32(-2.0) * abs(z))
    h = e / (np.float32(1.0) + e)
    h = np.float32(0.0) if h < _ROUNDS else h
    s = np.float32(1.0) - h if z >= np.float32(0.0) else h
    return s, h * (np.float32(1.0) - h)


@inline
def gelu_tanh(x):
    s, _ = _halves(x, x * x)
    return np.float32(0.5) * x * (np.float32(2.0) * s)


@inline
def gelu_tanh_grad(x):
    x2 = x * x
    s, hh = _halves(x, x2)
    left, right = np.float32(0.5) * x, np.float32(2.0) * s
    dright = left * (np.float32(4.0) * hh) * (_BETA * (np.float32(1.0) + np.float32(3.0) * _KAPPA * x2))
    return left * right, s + dright


_KERNELS = gated_kernels(gelu_tanh, gelu_tanh_grad)


def forward(tensors, attrs, config):
    return gated_forward(_KERNELS, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(_KERNELS, grads, tensors, config)


SERIAL_BELOW = 32_768
"""Elements of gate below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""

CPU_FUSED = gated_impl(GEGLU, forward, backward, fake, SERIAL_BELOW)
