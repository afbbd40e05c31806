"""Softmax: ``torch.softmax(x, dim)``."""

from __future__ import annotations

import torch

from ...registry import call, integer
from . import cpu as _cpu  # noqa: F401  (registers softmax.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import SOFTMAX


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Same result as ``torch.softmax(x, dim)``."""
    return call(SOFTMAX, (x,), (integer(dim),))


__all__ = ["SOFTMAX", "softmax"]
