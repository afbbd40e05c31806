"""GeGLU: ``torch.nn.functional.gelu(gate, approximate="tanh") * up``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers geglu.cpu_fused)
from . import nki as _nki  # noqa: F401  (registers geglu.nki_tiled)
from .op import GEGLU


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same result as ``torch.nn.functional.gelu(gate, approximate="tanh") * up``."""
    return call(GEGLU, (gate, up), ())


__all__ = ["GEGLU", "geglu"]
