"""SwiGLU: ``torch.nn.functional.silu(gate) * up``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers swiglu.cpu_fused)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import SWIGLU


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same result as ``torch.nn.functional.silu(gate) * up``."""
    return call(SWIGLU, (gate, up), ())


__all__ = ["SWIGLU", "swiglu"]
