"""Embedding lookup: ``weight[ids]``; its weight gradient is a scatter-add, zero at ``padding_idx``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.indices import make_index, sample_or


def reference(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    return F.embedding(ids, weight, padding_idx)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, dist: str = "zipf", sort: bool = False,
                **_) -> tuple[torch.Tensor, ...]:
    """Token ids are Zipf-skewed by default (frequent tokens repeat: the scatter-add's hard case); with a
    ``padding_idx``, a few positions are padding."""
    ids_spec, w = key.inputs
    ids = sample_or(samples, "ids", ids_spec.shape)
    if ids is None:
        ids = make_index(ids_spec.shape, w.shape[0], gen, dist, sort)
        pad = padding_row(key.attr_dict.get("padding_idx"), w.shape[0])
        if pad is not None:
            ids = ids.masked_fill(torch.rand(ids.shape, generator=gen) < 0.05, pad)
    return ids.to(getattr(torch, ids_spec.dtype)), torch.randn(w.shape, generator=gen, dtype=getattr(torch, w.dtype))


def padding_row(padding_idx: int | None, rows: int) -> int | None:
    """The weight row ``padding_idx`` names (negative counts from the end, as in ``F.embedding``); None when it
    names none (no padding, or out of range: ``F.embedding`` rejects that)."""
    if padding_idx is None or not -rows <= padding_idx < rows:
        return None
    return padding_idx % rows


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    ids, w = tensors
    return (w.new_empty((*ids.shape, w.shape[1])),)


def draw(rng, dtype: str) -> tuple:
    n, v, d = size(rng, 200), size(rng, 500) or 1, size(rng, 150)  # a vocabulary of at least one row
    ids = (2, n) if rng.random() < 0.5 else (n,)
    return ((ids, "int64"), ((v, d), dtype)), {"padding_idx": rng.choice([None, 0, v - 1, -1, -v])}

BENCHMARKS = (
    ((((4, 256), "int64"), ((32000, 256), "float32")), {"padding_idx": 0}, {"dist": "zipf"}),
    *(((((8, 1024), "int64"), ((32000, 512), "float32")), {}, {"dist": dist, "sort": sort})
      for dist in ("uniform", "zipf") for sort in (False, True)),
)
"""Token embeddings for ``benchmarks/test_pack.py``: text's skewed ids (zipf) and uniform ones, sorted or not."""

EMBEDDING = register_op(Op(
    name="embedding", reference=reference, tensors=("ids", "weight"), attrs={"padding_idx": int | None},
    defaults={"padding_idx": None}, differentiable=("weight",), data_dependent=("ids",), make_inputs=make_inputs,
    draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1,), "int64"), ((3, 4), "float32")), {}),
        ((((6, 5), "int64"), ((20, 8), "float32")), {"padding_idx": 0}),
        ((((5, 7), "int64"), ((50, 33), "float32")), {}),
        ((((4, 256), "int64"), ((2048, 128), "float32")), {}),
    ),
))
