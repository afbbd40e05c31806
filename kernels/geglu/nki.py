"""GeGLU in NKI: the gated tiling (``shared/gated_nki.py``) with the tanh-approximated GELU:
``gelu_apprx_tanh`` on ScalarE forward; backward, with th = tanh(sqrt(2/pi) * x * (1 + 0.044715 x^2)),
``gelu(x) = 0.5 x (1 + th)`` and ``gelu'(x) = 0.5 (1 + th) + 0.5 sqrt(2/pi) x (1 - th^2) (1 + 3 * 0.044715 x^2)``
(PyTorch's formula), on ScalarE (square, tanh) and VectorE."""

from __future__ import annotations

from ..shared.gated import fake
from ..shared.gated_nki import gated_backward, gated_forward, gated_impl, gelu_tanh_bwd, gelu_tanh_fwd
from .op import GEGLU


def forward(tensors, attrs, config):
    return gated_forward(gelu_tanh_fwd, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(gelu_tanh_bwd, grads, tensors, config)


NKI_TILED = gated_impl(GEGLU, forward, backward, fake, temporaries=3)
