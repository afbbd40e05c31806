"""Rotary position embedding of queries and keys (Hugging Face Llama convention)."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers rope.cpu_positions)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import ROPE


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as ``(q*c + rot(q)*s, k*c + rot(k)*s)`` with ``c, s = cos.unsqueeze(1), sin.unsqueeze(1)``
    and ``rot(x) = cat(-x[..., d/2:], x[..., :d/2], -1)``; q, k [batch, heads, seq, dim], cos, sin [batch, seq, dim]."""
    return call(ROPE, (q, k, cos, sin), ())


__all__ = ["ROPE", "rope"]
