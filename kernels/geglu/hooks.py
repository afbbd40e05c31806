"""Where GeGLU runs in a model: Gemma's GELU(tanh)-gated MLP."""

from __future__ import annotations

from functools import partial

import torch

from ..shared.hooks import FamilyHook, gelu_tanh_mlps
from . import geglu


def geglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))`` of Gemma's MLP."""
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


FAMILY = FamilyHook(find=gelu_tanh_mlps, forwards=(geglu_mlp_forward,),
                    bind=lambda module, family: partial(geglu_mlp_forward, module))
