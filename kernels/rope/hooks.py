"""Where the rotary embedding runs in a model: inside each Hugging Face family's attention that rotates whole heads
(not a NoPE layer of SmolLM3, not a partial rotary embedding), the modeling module's ``apply_rotary_pos_emb``
routed to ``nk.rope`` (``hf/routes.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..shared.hooks import FamilyHook, Route
from . import rope


def _router(original: Callable, active: Callable[[], bool]) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args,
                             **kwargs):
        if (args or kwargs or not active()
                or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3
                or cos.shape[-1] != q.shape[-1]  # a partial rotary embedding (Phi-3's may be): the original's
                or not q.dtype == k.dtype == cos.dtype == sin.dtype):  # OLMo 2's casts back to q's: the original's
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _rotates_whole_heads(attention: nn.Module) -> bool:
    """Whether the attention applies its rotary embedding to the whole head dim: not a NoPE layer (SmolLM3's
    ``use_rope`` false: no rotary embedding at all), not a partial rotary embedding (``partial_rotary_factor``
    below 1, which Phi-3's configs may set: it rotates the first dims and passes the rest through)."""
    if not getattr(attention, "use_rope", True):
        return False
    config = attention.config
    params = getattr(config, "rope_parameters", None) or {}  # transformers 5; 4.57 keeps it on the config
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return factor is None or float(factor) == 1.0


def _attentions(model: nn.Module, family):
    attention = family.cls("Attention")
    for name, m in model.named_modules():
        if type(m) is attention and _rotates_whole_heads(m):
            yield name, m


FAMILY = FamilyHook(find=_attentions, route=Route("apply_rotary_pos_emb", _router, reads="call",
                                                  what="rotary embedding"))
