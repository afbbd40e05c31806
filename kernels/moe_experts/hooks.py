"""Where the experts run in a model: each Hugging Face MoE family's experts module (transformers 5's
``@use_experts_implementation`` classes: gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I], no
bias), its instance ``forward`` bound to the op (``nk.moe_experts``'s call, with the module's own forward as the
fallback). The router, ``top_k`` and ``norm_topk_prob`` stay in
the family's own code: the op gets what the router gives."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ...registry import call
from ..shared.hooks import FamilyHook
from .op import MOE_EXPERTS


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    act: str = "silu") -> torch.Tensor:
    """``Qwen3MoeExperts.forward`` (Mixtral's and OLMoE's too): the tokens' routed experts, weighted and summed.
    Where no kernel is chosen, the module's own forward runs (the experts implementation its config names, e.g.
    ``grouped_mm``), not the op's dense expression: a kernel switched off leaves the model as transformers runs
    it."""
    return call(MOE_EXPERTS, (hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj), (act,),
                fallback=lambda: type(self).forward(self, hidden_states, top_k_index, top_k_weights))


def _act(module: nn.Module) -> str | None:
    """The op's name for the module's activation (transformers' ``hidden_act``), None for another."""
    from transformers.activations import GELUActivation, GELUTanh, SiLUActivation

    fn = getattr(module, "act_fn", None)
    if type(fn) in (SiLUActivation, nn.SiLU):
        return "silu"
    if type(fn) is GELUTanh:
        return "gelu_pytorch_tanh"
    if type(fn) is GELUActivation and not getattr(fn, "use_gelu_python", False):
        return "gelu"
    return None


_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False, "_is_expert_parallel": False}
"""The layout ``use_experts_implementation`` records on the module that the op computes."""


def _plain(m: nn.Module) -> bool:
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3):
        return False
    e, i2, h = gu.shape
    return (tuple(down.shape) == (e, h, i2 // 2) and _act(m) is not None
            and all(getattr(m, k, v) == v for k, v in _LAYOUT.items()))


def _experts(model: nn.Module, family):
    cls = family.cls("Experts")
    if cls is None:
        return
    for name, m in model.named_modules():
        if type(m) is cls and _plain(m):
            yield name, m


def _bind(module: nn.Module, family) -> partial:
    return partial(experts_forward, module, act=_act(module))


FAMILY = FamilyHook(find=_experts, forwards=(experts_forward,), bind=_bind, keyword="experts")
