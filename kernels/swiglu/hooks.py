"""Where SwiGLU runs in a model: each Hugging Face family's SiLU-gated MLP (Phi-3's fused ``gate_up_proj`` split in
half)."""

from __future__ import annotations

import torch

from ..shared.hooks import FamilyHook, family_forward, silu_mlps
from . import swiglu


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` of a SiLU-gated MLP."""
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Phi3MLP.forward``: ``down(up * act(gate))`` with gate and up the two halves of ``gate_up_proj(x)``, passed
    as views of it (no copy)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(swiglu(gate, up))


_FORWARDS = {f.__name__: f for f in (mlp_forward, fused_mlp_forward)}


FAMILY = FamilyHook(find=silu_mlps, forwards=tuple(_FORWARDS.values()),
                    bind=family_forward(_FORWARDS, lambda family: family.mlp))
