"""RMSNorm: the op, its reference and its benchmark inputs."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None) -> tuple[torch.Tensor, ...]:
    (xs, xd), (ws, wd) = key.inputs
    x = torch.randn(xs, generator=gen, dtype=getattr(torch, xd))
    w = 1.0 + 0.1 * torch.randn(ws, generator=gen, dtype=getattr(torch, wd))
    return x, w


RMSNORM = register_op(Op(
    name="rmsnorm",
    reference=reference,
    tensors=("x", "weight"),
    attrs={"eps": float},
    defaults={"eps": 1e-6},
    differentiable=("x", "weight"),
    make_inputs=make_inputs,
    examples=(
        ((((1, 7), "float32"), ((7,), "float32")), {}),
        ((((33, 129), "float32"), ((129,), "float32")), {}),
        ((((2, 64, 256), "float32"), ((256,), "float32")), {}),
        ((((3, 129, 200), "bfloat16"), ((200,), "bfloat16")), {}),
    ),
))
