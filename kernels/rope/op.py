"""Rotary position embedding (the Hugging Face Llama convention) on queries and keys."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op
from ..shared.draws import size


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), -1)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor, ...]:
    qs, ks, cs, _ = key.inputs
    q = torch.randn(qs.shape, generator=gen, dtype=getattr(torch, qs.dtype))
    k = torch.randn(ks.shape, generator=gen, dtype=getattr(torch, ks.dtype))
    b, s, d = cs.shape
    inv = 1.0 / (10000.0 ** (torch.arange(0, d - d % 2, 2, dtype=torch.float64) / max(d, 1)))
    pos = torch.arange(s, dtype=torch.float64) + torch.randint(0, 1000, (b, 1), generator=gen)
    ang = pos.unsqueeze(-1) * inv
    emb = torch.cat((ang, ang), -1)[..., :d]
    return q, k, emb.cos().to(getattr(torch, cs.dtype)), emb.sin().to(getattr(torch, cs.dtype))


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, _, _ = tensors
    return q.new_empty(q.shape), k.new_empty(k.shape)


def shape_problem(specs, attrs: dict) -> str | None:
    """What every impl declines alike: other ranks, other broadcasts of cos/sin, an odd head dim."""
    q, k, c, s = specs
    if len(q.shape) != 4 or len(k.shape) != 4 or len(c.shape) != 3 or c.shape != s.shape:
        return "shapes other than q, k [batch, heads, seq, dim] and cos, sin [batch, seq, dim]"
    b, _, n, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (n, d) or c.shape[1:] != (n, d) or c.shape[0] not in (1, b):
        return (f"shapes q {list(q.shape)}, k {list(k.shape)}, cos {list(c.shape)} (no broadcasting but cos/sin "
                "of batch 1)")
    if d % 2:
        return f"odd head dim {d}"
    return None


def draw(rng, dtype: str) -> tuple:
    b, s, d = rng.randint(1, 2), size(rng, 64), 2 * size(rng, 32)
    hq, hk = rng.choice([(4, 4), (4, 2), (1, 1)])
    cb = rng.choice([b, 1])  # Hugging Face passes batch 1 without position_ids
    return (((b, hq, s, d), dtype), ((b, hk, s, d), dtype), ((cb, s, d), dtype), ((cb, s, d), dtype)), {}

BENCHMARKS = (
    # Hugging Face's q/k: ``x.view(b, s, h, d).transpose(1, 2)``, needing a gradient; grouped k heads
    ((((4, 4, 256, 64), "float32", (256 * 4 * 64, 64, 4 * 64, 1), True),
      ((4, 2, 256, 64), "float32", (256 * 2 * 64, 64, 2 * 64, 1), True),
      ((1, 256, 64), "float32"), ((1, 256, 64), "float32")), {}, {}),
    ((((8, 8, 512, 64), "float32"), ((8, 8, 512, 64), "float32"), ((8, 512, 64), "float32"),
      ((8, 512, 64), "float32")), {}, {}),
)
"""Call sites for ``benchmarks/test_pack.py``."""

ROPE = register_op(Op(
    name="rope", reference=reference, tensors=("q", "k", "cos", "sin"), outputs=2,
    differentiable=("q", "k", "cos", "sin"), sources=(("q", "cos", "sin"), ("k", "cos", "sin")),
    make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 1, 1, 2), "float32"), ((1, 1, 1, 2), "float32"), ((1, 1, 2), "float32"), ((1, 1, 2), "float32")),
         {}),
        ((((2, 4, 9, 16), "float32"), ((2, 2, 9, 16), "float32"), ((2, 9, 16), "float32"),
          ((2, 9, 16), "float32")), {}),
        ((((2, 8, 64, 64), "float32"), ((2, 8, 64, 64), "float32"), ((2, 64, 64), "float32"),
         ((2, 64, 64), "float32")), {}),
        ((((3, 4, 17, 32), "bfloat16"), ((3, 2, 17, 32), "bfloat16"), ((1, 17, 32), "bfloat16"),
          ((1, 17, 32), "bfloat16")), {}),
    ),
))
