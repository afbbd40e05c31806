"""GeGLU on the CPU (numba): the gated pass (``shared/gated_cpu.py``) with the tanh-approximated GELU of
``shared/activations_cpu.py``."""

from __future__ import annotations

from ..shared.activations_cpu import gelu_tanh, gelu_tanh_grad
from ..shared.gated import fake
from ..shared.gated_cpu import gated_backward, gated_forward, gated_impl, gated_kernels
from .op import GEGLU

KERNELS = gated_kernels(gelu_tanh, gelu_tanh_grad)


def forward(tensors, attrs, config):
    return gated_forward(KERNELS, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(KERNELS, grads, tensors, config)


SERIAL_BELOW = 32_768
"""Elements of gate below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""

CPU_FUSED = gated_impl(GEGLU, forward, backward, fake, SERIAL_BELOW)
