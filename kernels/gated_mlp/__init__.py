"""A gated MLP, ``down(act(gate(x)) * up(x))``, as one op: tiles of tokens, each product on the faster library."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers gated_mlp.cpu_tiled and cpu_kept)
from . import nki as _nki  # noqa: F401  (registers gated_mlp.nki_fused)
from .op import GATED_MLP


def gated_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor | None,
              down_weight: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """Same result as ``F.linear(act(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)``; with
    ``up_weight`` None, ``gate_weight`` is a fused ``gate_up`` [2 * inter, hidden], gate rows first (Phi-3's).
    ``act``: ``"silu"`` or ``"gelu_pytorch_tanh"``."""
    return call(GATED_MLP, (x, gate_weight, up_weight, down_weight), (act,))


__all__ = ["GATED_MLP", "gated_mlp"]
