"""SwiGLU in NKI: the gated tiling of ``shared/gated_nki.py`` with ScalarE's ``silu`` and ``silu_dx``."""

from __future__ import annotations

from ...registry.neuron.nki import nki, nl
from ..shared.gated import fake
from ..shared.gated_nki import gated_backward, gated_bwd, gated_forward, gated_fwd, gated_impl, silu_tiles
from .op import SWIGLU


@nki.jit
def swiglu_fwd(gate, glead, up, ulead, f, rows_per_tile, cols):
    return gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, nl.silu)


@nki.jit
def swiglu_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols):
    return gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, silu_tiles)


def forward(tensors, attrs, config):
    return gated_forward(swiglu_fwd, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(swiglu_bwd, grads, tensors, config)


NKI_TILED = gated_impl(SWIGLU, forward, backward, fake, temporaries=2)
