"""Softmax: ``torch.softmax(x, dim)``."""

from __future__ import annotations

import operator

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers softmax.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import SOFTMAX


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Same result as ``torch.softmax(x, dim)``."""
    return call(SOFTMAX, (x,), (operator.index(dim),))


__all__ = ["SOFTMAX", "softmax"]
