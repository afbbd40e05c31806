"""Where the linear layer runs in a model: the projections of each Hugging Face family's attention (q/k/v/o, Phi-3's
fused ``qkv_proj``) and of its MLP (gate/up/down, Phi-3's fused ``gate_up_proj``), every ``nn.Linear`` that is a
direct child of one. Each is bound to ``nk.linear`` with its own weight and bias, so the recorder labels each
projection by its module (``model.layers.0.self_attn.o_proj``) and the table decides per shape. The head stays
with the fused loss (``linear_cross_entropy``); a router's linear layer (a MoE block's ``gate``) is not a child
of either and is left as it is. The patch keyword is ``projections``."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..shared.hooks import FamilyHook
from . import linear


def linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``: ``F.linear(x, weight, bias)``, no casts."""
    return linear(x, self.weight, self.bias)


def _projections(model: nn.Module, family):
    owners = tuple(c for c in (family.cls("Attention"), family.cls("MLP")) if c is not None)
    for name, m in model.named_modules():
        if type(m) in owners:
            for child, c in m.named_children():
                if type(c) is nn.Linear:
                    yield f"{name}.{child}", c


def _bind(module: nn.Module, family) -> partial:
    return partial(linear_forward, module)


FAMILY = FamilyHook(find=_projections, forwards=(linear_forward,), bind=_bind, keyword="projections")
