"""squared_relu's contract: signature, reference (the compiler path; in float64 the oracle), fake, inputs, draws."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op
from ..shared.draws import rows, size


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) ** 2


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor, ...]:
    """Values on both sides of 0, so both branches of relu run."""
    return tuple(torch.randn(s.shape, generator=gen, dtype=getattr(torch, s.dtype)) for s in key.inputs)


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    """The outputs' shapes and dtypes, for tracing."""
    (x,) = tensors
    return (x.new_empty(x.shape),)


def draw(rng, dtype: str) -> tuple:
    """One fresh call of the same form as an example (``kernels/shared/draws.py``: sizes the special-values tests
    can shrink)."""
    return (((rows(rng, size(rng, 400))), dtype),), {}


SQUARED_RELU = register_op(Op(
    name="squared_relu", reference=reference, tensors=("x",), differentiable=("x",), make_inputs=make_inputs,
    draw=draw,
    examples=(  # what `nki-autotune check` and the generic tests run every impl on
        ((((1, 3), "float32"),), {}),
        ((((7, 333), "float32"),), {}),
        ((((2, 64, 96), "bfloat16"),), {}),
    ),
    benchmarks=(((((4096, 1024), "float32"),), {}, {}),),  # call sites for benchmarks/test_pack.py
))
