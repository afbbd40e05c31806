"""Where GeGLU runs in a model: Gemma's GELU(tanh)-gated MLP."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.hooks import FamilyHook
from . import geglu


def geglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))`` of Gemma's MLP."""
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


def _gelu_tanh(act: nn.Module | None) -> bool:
    """Whether ``act`` is ``F.gelu(x, approximate="tanh")``: transformers' ``gelu_pytorch_tanh`` (``GELUTanh``, in
    older versions ``PytorchGELUTanh``; not its pure-Python formula, ``gelu_python_tanh``) or ``nn.GELU("tanh")``."""
    import transformers.activations as acts

    if type(act) is nn.GELU:
        return act.approximate == "tanh"
    if type(act) not in {getattr(acts, n, None) for n in ("GELUTanh", "PytorchGELUTanh")} - {None}:
        return False
    fn = getattr(act, "act", None)  # GELUTanh holds its function; PytorchGELUTanh calls F.gelu in its forward
    return fn is None or (isinstance(fn, partial) and fn.func is F.gelu and fn.keywords == {"approximate": "tanh"})


def _mlps(model: nn.Module, family):
    if family.mlp != "geglu_mlp_forward":
        return
    mlp = family.cls("MLP")
    for name, m in model.named_modules():
        if type(m) is mlp and _gelu_tanh(getattr(m, "act_fn", None)):
            yield name, m


FAMILY = FamilyHook(find=_mlps, forwards=(geglu_mlp_forward,),
                    bind=lambda module, family: partial(geglu_mlp_forward, module))
