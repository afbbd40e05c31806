"""RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers rmsnorm.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers rmsnorm.nki_tiled)
from .op import RMSNORM


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """Same result as ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)``: the weight
    itself at offset 0 (Llama), ``1 + weight`` at offset 1 (Gemma, whose cast order is: compute in float32, cast the
    product at the end); ``weight=None`` scales by nothing (``torch.nn.RMSNorm(..., elementwise_affine=False)``)."""
    if weight is None and offset != 0.0:
        raise ValueError(f"nk.rmsnorm: offset={offset} needs a weight (the scale is offset + weight)")
    return call(RMSNORM, (x, weight), (float(eps), float(offset)))


__all__ = ["RMSNORM", "rmsnorm"]
