"""SwiGLU: ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import rows, size


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor, ...]:
    return tuple(2.0 * torch.randn(s.shape, generator=gen, dtype=getattr(torch, s.dtype)) for s in key.inputs)


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    g, _ = tensors
    return (g.new_empty(g.shape),)


def draw(rng, dtype: str) -> tuple:
    shape = rows(rng, size(rng, 400))
    return ((shape, dtype), (shape, dtype)), {}

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
