"""GeGLU in NKI: the gated tiling (``shared/gated_nki.py``) with the tanh-approximated GELU:
``gelu_apprx_tanh`` on ScalarE forward; backward, with th = tanh(sqrt(2/pi) * x * (1 + 0.044715 x^2)),
``gelu(x) = 0.5 x (1 + th)`` and ``gelu'(x) = 0.5 (1 + th) + 0.5 sqrt(2/pi) x (1 - th^2) (1 + 3 * 0.044715 x^2)``
(PyTorch's formula), on ScalarE (square, tanh) and VectorE."""

from __future__ import annotations

import math

from ...registry.neuron.nki import nisa, nki, nl
from ..shared.gated import fake
from ..shared.gated_nki import gated_backward, gated_bwd, gated_forward, gated_fwd, gated_impl
from .op import GEGLU

_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _gelu_tanh_tiles(g, t, n, m):
    """gelu(g) into t; gelu'(g) returned."""
    g = g[0:n, 0:m]
    sq = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq[0:n, 0:m], op=nl.square, data=g)
    d = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=d[0:n, 0:m], data=sq[0:n, 0:m], op0=nl.multiply, operand0=_KAPPA, op1=nl.add,
                       operand1=1.0)
    nisa.scalar_tensor_tensor(dst=d[0:n, 0:m], data=g, op0=nl.multiply, operand0=_BETA, op1=nl.multiply,
                              operand1=d[0:n, 0:m])
    nisa.activation(dst=d[0:n, 0:m], op=nl.tanh, data=d[0:n, 0:m])  # th
    nisa.tensor_scalar(dst=t[0:n, 0:m], data=d[0:n, 0:m], op0=nl.add, operand0=1.0, op1=nl.multiply,
                       operand1=0.5)  # h = 0.5 (1 + th)
    nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=d[0:n, 0:m], op=nl.multiply)
    nisa.tensor_scalar(dst=d[0:n, 0:m], data=d[0:n, 0:m], op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=1.0)  # 1 - th^2
    nisa.tensor_scalar(dst=sq[0:n, 0:m], data=sq[0:n, 0:m], op0=nl.multiply, operand0=3.0 * _KAPPA, op1=nl.add,
                       operand1=1.0)
    nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=sq[0:n, 0:m], op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=d[0:n, 0:m], data=g, op0=nl.multiply, operand0=0.5 * _BETA, op1=nl.multiply,
                              operand1=d[0:n, 0:m])
    nisa.tensor_tensor(dst=d[0:n, 0:m], data1=d[0:n, 0:m], data2=t[0:n, 0:m], op=nl.add)  # gelu'
    nisa.tensor_tensor(dst=t[0:n, 0:m], data1=t[0:n, 0:m], data2=g, op=nl.multiply)  # gelu = h * x
    return d


@nki.jit
def geglu_fwd(gate, glead, up, ulead, f, rows_per_tile, cols):
    return gated_fwd(gate, glead, up, ulead, f, rows_per_tile, cols, nl.gelu_apprx_tanh)


@nki.jit
def geglu_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols):
    return gated_bwd(dy, gate, glead, up, ulead, rows_per_tile, cols, _gelu_tanh_tiles)


def forward(tensors, attrs, config):
    return gated_forward(geglu_fwd, tensors, config)


def backward(grads, tensors, results, attrs, config, needs):
    return gated_backward(geglu_bwd, grads, tensors, config)


NKI_TILED = gated_impl(GEGLU, forward, backward, fake, temporaries=3)
