"""RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * weight``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers rmsnorm.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers rmsnorm.nki_tiled)
from .op import RMSNORM


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Same result as ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight``."""
    return call(RMSNORM, (x, weight), (float(eps),))


__all__ = ["RMSNORM", "rmsnorm"]
