"""RMSNorm: the op, its reference and its benchmark inputs."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op
from ..shared.draws import rows, size


def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (offset + weight)``: ``offset + weight`` is Gemma's ``1 + weight`` (offset 1),
    the weight itself at offset 0; no weight (``torch.nn.RMSNorm(elementwise_affine=False)``): no scale."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y
    return y * (weight if offset == 0.0 else offset + weight)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None) -> tuple[torch.Tensor, ...]:
    xs, ws = key.inputs
    x = torch.randn(xs.shape, generator=gen, dtype=getattr(torch, xs.dtype))
    if ws is None:
        return x, None
    # a scale (offset + weight) near 1, whatever the offset: Gemma's weights are near 0
    w = 1.0 - key.attr_dict.get("offset", 0.0) + 0.1 * torch.randn(ws.shape, generator=gen,
                                                                  dtype=getattr(torch, ws.dtype))
    return x, w


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """y, and the per-row rstd (float32) every impl keeps for its backward."""
    x, _ = tensors
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def scale(x: torch.Tensor, weight: torch.Tensor | None, attrs: dict) -> tuple[torch.Tensor, float]:
    """The weight and offset the kernels take: no weight is a weight of ones (x's dtype: the same kernel signature)
    at offset 0, an exact product."""
    if weight is None:
        return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 0.0
    return weight, attrs.get("offset", 0.0)  # keys written before the offset existed hold only eps


def shape_problem(specs, attrs: dict) -> str | None:
    x, w = specs
    if not x.shape:
        return "x of shape [] (needs at least one dim)"
    if w is not None and w.shape != x.shape[-1:]:
        return f"weight of shape {list(w.shape)} (needs [{x.shape[-1]}], no broadcasting)"
    if w is None and attrs.get("offset", 0.0) != 0.0:
        return "an offset without a weight (the expression scales by nothing)"
    if x.shape[-1] == 1 and x.requires_grad:
        return ("rows of one element needing x's gradient (it is eps / (x^2 + eps) of the output's, a difference of "
                "nearly equal terms in the kernels' formula)")
    return None


def draw(rng, dtype: str) -> tuple:
    d = size(rng, 150)
    shape = rows(rng, d + 1 if d else 0)  # rows of one element needing x's gradient are declined
    offset = rng.choice([0.0, 1.0])
    weight = None if offset == 0.0 and rng.random() < 0.2 else (shape[-1:], dtype)
    return ((shape, dtype), weight), {"eps": rng.choice([1e-6, 1e-5]), "offset": offset}

BENCHMARKS = tuple((((shape, "float32"), (shape[-1:], "float32")), {}, {})
                   for shape in ((8, 64), (512, 256), (4, 256, 256), (2048, 512), (8192, 1024)))
"""Real models' call sites for ``benchmarks/test_pack.py``: hidden sizes 64 to 1024, up to 8192 tokens."""

RMSNORM = register_op(Op(
    name="rmsnorm",
    reference=reference,
    tensors=("x", "weight"),
    optional=("weight",),
    attrs={"eps": float, "offset": float},
    defaults={"eps": 1e-6, "offset": 0.0},
    differentiable=("x", "weight"),
    make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 7), "float32"), ((7,), "float32")), {}),
        ((((33, 129), "float32"), ((129,), "float32")), {}),
        ((((2, 64, 256), "float32"), ((256,), "float32")), {}),
        ((((3, 129, 200), "bfloat16"), ((200,), "bfloat16")), {}),
        ((((3, 40, 72), "bfloat16"), ((72,), "bfloat16")), {"offset": 1.0}),
        ((((9, 40), "float32"), None), {}),
    ),
))
