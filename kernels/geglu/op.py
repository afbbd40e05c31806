"""GeGLU: ``gelu(gate, approximate="tanh") * up`` (Gemma's MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Op, register_op
from ..shared.gated import draw, make_inputs


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


BENCHMARKS = tuple((((shape, "float32"), (shape, "float32")), {}, {})
                   for shape in ((4, 256, 512), (2048, 2048)))
"""Gemma's MLP widths for ``benchmarks/test_pack.py``."""

GEGLU = register_op(Op(
    name="geglu", reference=reference, tensors=("gate", "up"), differentiable=("gate", "up"),
    make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    waives={"float64 within 1e-5": "gelu's 1 + tanh rounds to 0 in float32 for gates below about -5.3: there the "
            "kernel is -0 as PyTorch's float32 is, and float64 is not; held to float32's own error instead"},
    examples=(
        ((((1, 3), "float32"), ((1, 3), "float32")), {}),
        ((((7, 333), "float32"), ((7, 333), "float32")), {}),
        ((((2, 64, 96), "bfloat16"), ((2, 64, 96), "bfloat16")), {}),
    ),
))
