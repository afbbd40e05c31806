"""The gates' activations on the CPU, as ``inline`` numba functions of one float32 (``f(x)``, and ``f_grad(x) ->
(f(x), f'(x))``), bound into the kernels of the gated ops and the experts.

SiLU is PyTorch's formula, ``x / (1 + exp(-x))``, its derivative ``s * (1 + x * (1 - s))``, so inf and nan land
where they land in PyTorch.

The tanh-approximated GELU is PyTorch's function, ``gelu(x) = 0.5 x (1 + t)`` with ``t = tanh(z)``,
``z = sqrt(2/pi) (x + 0.044715 x^3)``, and its derivative ``0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi)
(1 + 3 * 0.044715 x^2)``, taken through the logistic
``s = 0.5 (1 + t) = 1 / (1 + exp(-2z))``: with ``h = e / (1 + e)``, ``e = exp(-2|z|)``, ``s`` is ``1 - h`` or
``h`` by the sign of z and ``1 - t^2 = 4 h (1 - h)``. ``1 + t`` written out cancels in float32 once z is below
about -1 (at x = -3 it keeps one digit in four); ``h`` does not, so the kernel is as close to float64 as PyTorch's
float32 or closer. It saturates where PyTorch does: ``h`` is 0 where t rounded to float32 is ±1 (x below about
-5.3: gelu is -0 and its derivative 0, so an infinite ``up`` or output gradient gives nan as in PyTorch), and inf
and nan land where they land in PyTorch (gelu(-inf) is nan, as ``-inf * 0``; the derivative is nan at ±inf and
where ``x^2`` overflows, as ``0 * inf``). One
``registry.cpu.runtime.exp32`` per element, which vectorises (numba here has no SVML, and a libm call per element
would not vectorise).

GELU (exact) is ``0.5 x (1 + erf(x / sqrt 2))``, its derivative ``0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) /
sqrt(2 pi)``: a libm ``erf`` per element (it does not vectorise).
"""

from __future__ import annotations

import math

import numpy as np

from ...registry.cpu.runtime import exp32, inline


@inline
def silu(x):
    return x / (np.float32(1.0) + exp32(-x))


@inline
def silu_grad(x):
    """silu(x) as its gradient's formula reads it (``x * s``), and its derivative."""
    s = np.float32(1.0) / (np.float32(1.0) + exp32(-x))
    return x * s, s * (np.float32(1.0) + x * (np.float32(1.0) - s))


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



_SQRT1_2 = np.float32(0.7071067811865476)
_INV_SQRT_2PI = np.float32(0.3989422804014327)


@inline
def gelu(x):
    return np.float32(0.5) * x * (np.float32(1.0) + np.float32(math.erf(x * _SQRT1_2)))


@inline
def gelu_grad(x):
    c = np.float32(0.5) * (np.float32(1.0) + np.float32(math.erf(x * _SQRT1_2)))
    return x * c, c + x * _INV_SQRT_2PI * exp32(np.float32(-0.5) * x * x)


__all__ = ["gelu", "gelu_grad", "gelu_tanh", "gelu_tanh_grad", "silu", "silu_grad"]
