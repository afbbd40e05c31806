"""GeGLU on the CPU (numba): the gated pass (``shared/gated_cpu.py``) with the tanh-approximated GELU of
``shared/activations_cpu.py``."""

from __future__ import annotations

from ..shared.gated import fake
from ..shared.gated_cpu import GELU_TANH, gated_backward, gated_forward, gated_impl
from .op import GEGLU


def forward(tensors, attrs, config):
    return gated_forward(GELU_TANH, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(GELU_TANH, grads, tensors, config)


SERIAL_BELOW = 32_768
"""Elements of gate below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""

CPU_FUSED = gated_impl(GEGLU, forward, backward, fake, SERIAL_BELOW)
