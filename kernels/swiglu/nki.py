"""SwiGLU in NKI: the gated tiling of ``shared/gated_nki.py`` with ScalarE's ``silu`` and ``silu_dx``."""

from __future__ import annotations

from ..shared.gated import fake
from ..shared.gated_nki import gated_backward, gated_forward, gated_impl, silu_bwd, silu_fwd
from .op import SWIGLU


def forward(tensors, attrs, config):
    return gated_forward(silu_fwd, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(silu_bwd, grads, tensors, config)


NKI_TILED = gated_impl(SWIGLU, forward, backward, fake, temporaries=2)
