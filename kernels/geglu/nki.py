"""GeGLU in NKI: the gated tiling (``shared/gated_nki.py``) with the tanh-approximated GELU:
``gelu_apprx_tanh`` on ScalarE forward; backward, with th = tanh(sqrt(2/pi) * x * (1 + 0.044715 x^2)),
``gelu(x) = 0.5 x (1 + th)`` and ``gelu'(x) = 0.5 (1 + th) + 0.5 sqrt(2/pi) x (1 - th^2) (1 + 3 * 0.044715 x^2)``
(PyTorch's formula), on ScalarE (square, tanh) and VectorE."""

from __future__ import annotations

from ...registry.neuron.nki import nki, nl
from ..shared.gated import fake
from ..shared.gated_nki import gated_backward, gated_bwd, gated_forward, gated_fwd, gated_impl, gelu_tanh_tiles
from .op import GEGLU


@nki.jit
def geglu_fwd(gate, glead, up, ulead, f, rows_per_tile, cols):
    return gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, nl.gelu_apprx_tanh)


@nki.jit
def geglu_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols):
    return gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, gelu_tanh_tiles)


def forward(tensors, attrs, config):
    return gated_forward(geglu_fwd, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(geglu_bwd, grads, tensors, config)


NKI_TILED = gated_impl(GEGLU, forward, backward, fake, temporaries=3)
