"""Rotary position embedding (the Hugging Face Llama convention) on queries and keys."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), -1)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor, ...]:
    (qs, qd), (ks, kd), (cs, cd), _ = key.inputs
    q = torch.randn(qs, generator=gen, dtype=getattr(torch, qd))
    k = torch.randn(ks, generator=gen, dtype=getattr(torch, kd))
    b, s, d = cs
    inv = 1.0 / (10000.0 ** (torch.arange(0, d - d % 2, 2, dtype=torch.float64) / max(d, 1)))
    pos = torch.arange(s, dtype=torch.float64) + torch.randint(0, 1000, (b, 1), generator=gen)
    ang = pos.unsqueeze(-1) * inv
    emb = torch.cat((ang, ang), -1)[..., :d]
    return q, k, emb.cos().to(getattr(torch, cd)), emb.sin().to(getattr(torch, cd))


ROPE = register_op(Op(
    name="rope", reference=reference, tensors=("q", "k", "cos", "sin"), outputs=2,
    differentiable=("q", "k", "cos", "sin"), make_inputs=make_inputs,
    examples=(
        ((((1, 1, 1, 2), "float32"), ((1, 1, 1, 2), "float32"), ((1, 1, 2), "float32"), ((1, 1, 2), "float32")),
         {}),
        ((((2, 4, 9, 16), "float32"), ((2, 2, 9, 16), "float32"), ((2, 9, 16), "float32"),
          ((2, 9, 16), "float32")), {}),
        ((((2, 8, 64, 64), "float32"), ((2, 8, 64, 64), "float32"), ((2, 64, 64), "float32"),
         ((2, 64, 64), "float32")), {}),
    ),
))
