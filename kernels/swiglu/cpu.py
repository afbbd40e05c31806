"""SwiGLU on the CPU (numba): the gated pass of ``shared/gated_cpu.py`` with the SiLU of
``shared/activations_cpu.py``."""

from __future__ import annotations

from ..shared.gated import fake
from ..shared.gated_cpu import SILU, gated_backward, gated_forward, gated_impl
from .op import SWIGLU


def forward(tensors, attrs, config):
    return gated_forward(SILU, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(SILU, grads, tensors, config)


SERIAL_BELOW = 2_097_152
"""Elements of gate below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_FUSED = gated_impl(SWIGLU, forward, backward, fake, SERIAL_BELOW)
