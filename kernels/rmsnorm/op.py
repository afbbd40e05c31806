"""RMSNorm: the op, its reference and its benchmark inputs."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None) -> tuple[torch.Tensor, ...]:
    xs, ws = key.inputs
    x = torch.randn(xs.shape, generator=gen, dtype=getattr(torch, xs.dtype))
    w = 1.0 + 0.1 * torch.randn(ws.shape, generator=gen, dtype=getattr(torch, ws.dtype))
    return x, w


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """y, and the per-row rstd (float32) every impl keeps for its backward."""
    x, _ = tensors
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def shape_problem(specs, attrs: dict) -> str | None:
    x, w = specs
    if not x.shape:
        return "x of shape [] (needs at least one dim)"
    if w.shape != x.shape[-1:]:
        return f"weight of shape {list(w.shape)} (needs [{x.shape[-1]}], no broadcasting)"
    if x.shape[-1] == 1 and x.requires_grad:
        return ("rows of one element needing x's gradient (it is eps / (x^2 + eps) of the output's, a difference of "
                "nearly equal terms in the kernels' formula)")
    return None


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
