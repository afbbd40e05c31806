"""What the gated activations ``act(gate) * up`` (SwiGLU, GeGLU) share at the op level: their inputs, fake and
draws (gate and up of one shape)."""

from __future__ import annotations

import torch

from ...registry import Key
from .draws import rows, size


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor, ...]:
    return tuple(2.0 * torch.randn(s.shape, generator=gen, dtype=getattr(torch, s.dtype)) for s in key.inputs)


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    g, _ = tensors
    return (g.new_empty(g.shape),)


def draw(rng, dtype: str) -> tuple:
    shape = rows(rng, size(rng, 400))
    return ((shape, dtype), (shape, dtype)), {}
