"""Where the gated MLP runs in a model: each Hugging Face family's gated MLP whose projections have no bias, the
modules SwiGLU's and GeGLU's hooks find (Phi-3's fused ``gate_up_proj`` included), as one ``nk.gated_mlp`` call with
the module's own weights. It covers what those hooks and linear's bind inside it: where it takes an MLP, they
leave that MLP (and its projections) alone; ``patch(model, gated_mlp=False)`` gives them back."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..shared.hooks import FamilyHook, gelu_tanh_mlps, silu_mlps
from . import gated_mlp


def gated_mlp_forward(self, x: torch.Tensor, act: str) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))``, Phi-3's ``down(up * act(gate))`` alike (one product, rounded the same)."""
    if hasattr(self, "gate_up_proj"):
        return gated_mlp(x, self.gate_up_proj.weight, None, self.down_proj.weight, act)
    return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, act)


def _no_bias(module: nn.Module) -> bool:
    return all(c.bias is None for c in module.children() if isinstance(c, nn.Linear))


def _mlps(model: nn.Module, family):
    for find in (silu_mlps, gelu_tanh_mlps):
        for name, m in find(model, family):
            if _no_bias(m):
                yield name, m


def _bind(module: nn.Module, family) -> partial:
    act = "gelu_pytorch_tanh" if family.mlp == "geglu_mlp_forward" else "silu"
    return partial(gated_mlp_forward, module, act=act)


FAMILY = FamilyHook(find=_mlps, forwards=(gated_mlp_forward,), bind=_bind, covers=("geglu", "linear", "swiglu"))
