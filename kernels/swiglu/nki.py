"""SwiGLU in NKI: the gated tiling of ``shared/gated_nki.py`` with ScalarE's ``silu`` and ``silu_dx``."""

from __future__ import annotations

from ...registry.neuron.nki import nisa, nki, nl
from ..shared.gated import fake
from ..shared.gated_nki import gated_backward, gated_bwd, gated_forward, gated_fwd, gated_impl
from .op import SWIGLU


def _silu_tiles(g, t, n, m):
    nisa.activation(dst=t[0:n, 0:m], op=nl.silu, data=g[0:n, 0:m])
    d = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=d[0:n, 0:m], op=nl.silu_dx, data=g[0:n, 0:m])
    return d


@nki.jit
def swiglu_fwd(gate, glead, up, ulead, f, rows_per_tile, cols):
    return gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, nl.silu)


@nki.jit
def swiglu_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols):
    return gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, _silu_tiles)


def forward(tensors, attrs, config):
    return gated_forward(swiglu_fwd, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(swiglu_bwd, grads, tensors, config)


NKI_TILED = gated_impl(SWIGLU, forward, backward, fake, temporaries=2)
