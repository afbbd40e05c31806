"""Attention: ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
enable_gqa=True)``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers attention.cpu_flash)
from . import nki as _nki  # noqa: F401  (registers attention.nki_flash)
from .op import ATTENTION


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Same result as ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
    enable_gqa=True)``: q [batch, heads, sq, dim], k and v [batch, kv heads, sk, dim] with kv heads dividing heads
    (each k/v head serves a group of query heads); mask boolean (True: attend) or additive, broadcasting to
    [batch, heads, sq, sk]."""
    return call(ATTENTION, (q, k, v, mask), (bool(causal), None if scale is None else float(scale)))


__all__ = ["ATTENTION", "attention"]
