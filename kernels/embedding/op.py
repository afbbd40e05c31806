"""Embedding lookup: ``weight[ids]``; its weight gradient is a scatter-add."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from .._indices import make_index, sample_or


def reference(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, dist: str = "zipf", sort: bool = False,
                **_) -> tuple[torch.Tensor, ...]:
    """Token ids are Zipf-skewed by default (frequent tokens repeat: the scatter-add's hard case)."""
    ids_spec, w = key.inputs
    ids = sample_or(samples, "ids", ids_spec.shape)
    if ids is None:
        ids = make_index(ids_spec.shape, w.shape[0], gen, dist, sort)
    return ids, torch.randn(w.shape, generator=gen, dtype=getattr(torch, w.dtype))


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    ids, w = tensors
    return (w.new_empty((*ids.shape, w.shape[1])),)


EMBEDDING = register_op(Op(
    name="embedding", reference=reference, tensors=("ids", "weight"), differentiable=("weight",),
    data_dependent=("ids",), make_inputs=make_inputs,
    examples=(
        ((((1,), "int64"), ((3, 4), "float32")), {}),
        ((((5, 7), "int64"), ((50, 33), "float32")), {}),
        ((((4, 256), "int64"), ((2048, 128), "float32")), {}),
    ),
))
