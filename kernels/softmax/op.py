"""Softmax over a dim: the op, its reference and its benchmark inputs."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op
from ..shared.draws import rows, size


def reference(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x, dim)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor, ...]:
    (x,) = key.inputs
    return (3.0 * torch.randn(x.shape, generator=gen, dtype=getattr(torch, x.dtype)),)


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    (x,) = tensors
    return (x.new_empty(x.shape),)


def dim_problem(specs, attrs: dict) -> str | None:
    if attrs["dim"] not in (-1, len(specs[0].shape) - 1):
        return f"dim={attrs['dim']} (supports the last dim)"
    return None


def draw(rng, dtype: str) -> tuple:
    shape = rows(rng, size(rng, 400))
    return ((shape, dtype),), {"dim": rng.choice([-1, len(shape) - 1])}

BENCHMARKS = (
    ((((256, 128), "float32"),), {}, {}),
    ((((8, 4, 256, 256), "float32"),), {}, {}),  # attention scores: batch, heads, queries, keys
)
"""Call sites for ``benchmarks/test_pack.py``."""

SOFTMAX = register_op(Op(
    name="softmax", reference=reference, tensors=("x",), attrs={"dim": int}, defaults={"dim": -1},
    differentiable=("x",), make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 5), "float32"),), {}),
        ((((37, 129), "float32"),), {}),
        ((((2, 3, 16, 300), "float32"),), {}),
    ),
))
