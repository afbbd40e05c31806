"""Segment sum: rows of ``src`` added into ``num_segments`` rows by ``index``; its src gradient is a gather."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.indices import make_index, sample_or


def reference(src: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    return src.new_zeros(num_segments, *src.shape[1:]).index_add_(0, index, src)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, dist: str = "uniform",
                sort: bool = False, **_) -> tuple[torch.Tensor, ...]:
    src, index_spec = key.inputs
    index = sample_or(samples, "index", index_spec.shape)
    if index is None:
        index = make_index(index_spec.shape, key.attr_dict["num_segments"], gen, dist, sort)
    return torch.randn(src.shape, generator=gen, dtype=getattr(torch, src.dtype)), index


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    src, _ = tensors
    return (src.new_empty((attrs["num_segments"], *src.shape[1:])),)


def shape_problem(specs, attrs: dict) -> str | None:
    """What every impl declines alike: shapes other than index [N], src [N, ...], or a negative count."""
    src, index = specs
    if len(index.shape) != 1 or not src.shape or index.shape[0] != src.shape[0]:
        return f"src {list(src.shape)} and index {list(index.shape)} (supports index [N], src [N, ...])"
    if attrs["num_segments"] < 0:
        return f"num_segments={attrs['num_segments']} (must not be negative)"
    return None


def draw(rng, dtype: str) -> tuple:
    n, d = size(rng, 300), size(rng, 150)
    src = (n, 2, d) if rng.random() < 0.3 else (n, d)
    segments = rng.randint(min(n, 1), 2 * n or 1)  # more than rows, at times: some stay empty
    return ((src, dtype), ((n,), "int64")), {"num_segments": segments}

BENCHMARKS = tuple(((((65536, 64), "float32"), ((65536,), "int64")), {"num_segments": 4096},
                    {"dist": dist, "sort": sort})
                   for dist in ("uniform", "zipf") for sort in (False, True))
"""Graph-network sized scatters for ``benchmarks/test_pack.py``."""

SEGMENT_SUM = register_op(Op(
    name="segment_sum", reference=reference, tensors=("src", "index"), attrs={"num_segments": int},
    defaults={}, differentiable=("src",), data_dependent=("index",), make_inputs=make_inputs, draw=draw,
    benchmarks=BENCHMARKS,
    examples=(
        ((((1, 3), "float32"), ((1,), "int64")), {"num_segments": 1}),
        ((((40, 7), "float32"), ((40,), "int64")), {"num_segments": 9}),
        ((((1000, 2, 64), "float32"), ((1000,), "int64")), {"num_segments": 300}),
    ),
))
