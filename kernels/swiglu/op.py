"""SwiGLU: ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Op, register_op
from ..shared.gated import draw, make_inputs


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


BENCHMARKS = tuple((((shape, "float32"), (shape, "float32")), {}, {})
                   for shape in ((64, 256), (4, 256, 512), (2048, 2048)))
"""MLP widths for ``benchmarks/test_pack.py``."""

SWIGLU = register_op(Op(
    name="swiglu", reference=reference, tensors=("gate", "up"), differentiable=("gate", "up"),
    make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 3), "float32"), ((1, 3), "float32")), {}),
        ((((7, 333), "float32"), ((7, 333), "float32")), {}),
        ((((2, 64, 512), "float32"), ((2, 64, 512), "float32")), {}),
    ),
))
