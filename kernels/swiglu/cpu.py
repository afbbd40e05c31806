"""SwiGLU on the CPU (numba): the gated pass of ``shared/gated_cpu.py`` with SiLU, PyTorch's formulas
(``x / (1 + exp(-x))`` and its derivative ``s * (1 + x * (1 - s))``), so inf and nan land where they land in
PyTorch."""

from __future__ import annotations

import numpy as np

from ...registry.cpu.runtime import exp32, inline
from ..shared.gated import fake
from ..shared.gated_cpu import gated_backward, gated_forward, gated_impl, gated_kernels
from .op import SWIGLU


@inline
def silu(x):
    return x / (np.float32(1.0) + exp32(-x))


@inline
def silu_grad(x):
    """silu(x) as its gradient's formula reads it (``x * s``), and its derivative."""
    s = np.float32(1.0) / (np.float32(1.0) + exp32(-x))
    return x * s, s * (np.float32(1.0) + x * (np.float32(1.0) - s))


_KERNELS = gated_kernels(silu, silu_grad)


def forward(tensors, attrs, config):
    return gated_forward(_KERNELS, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(_KERNELS, grads, tensors, config)


SERIAL_BELOW = 2_097_152
"""Elements of gate below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_FUSED = gated_impl(SWIGLU, forward, backward, fake, SERIAL_BELOW)
