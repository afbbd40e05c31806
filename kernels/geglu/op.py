"""GeGLU: ``gelu(gate, approximate="tanh") * up`` (Gemma's MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Op, register_op
from ..swiglu.op import make_inputs


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


GEGLU = register_op(Op(
    name="geglu", reference=reference, tensors=("gate", "up"), differentiable=("gate", "up"),
    make_inputs=make_inputs,
    examples=(
        ((((1, 3), "float32"), ((1, 3), "float32")), {}),
        ((((7, 333), "float32"), ((7, 333), "float32")), {}),
        ((((2, 64, 96), "bfloat16"), ((2, 64, 96), "bfloat16")), {}),
    ),
))
