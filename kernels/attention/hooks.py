"""Where attention runs in a model: inside each Hugging Face family's attention, transformers' ``sdpa`` attention
function run by ``nk.attention`` (``hf/routes.py``; eager, flash and flex are left as they are).

transformers' attention modules find their attention function in ``ALL_ATTENTION_FUNCTIONS`` (a module-level
name of each modeling module, read when the forward runs: ``get_interface(config._attn_implementation, eager)``
in 5.x, ``ALL_ATTENTION_FUNCTIONS[...]`` in 4.57). While a model of a family is patched, that name holds an
``AttentionRouter``: inside a patched attention it hands out ``sdpa`` below for ``"sdpa"``, anywhere else (and for
every other implementation) what the registry holds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..shared.hooks import FamilyHook, Route
from . import attention


def sdpa(original: Callable, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` as ``nk.attention``: the same causal rule (causal where there is
    no mask and more than one query), the grouped heads taken as they are (transformers repeats them where there is
    a mask: the same result), the output [batch, seq, heads, dim]. What it does not take (dropout, a position bias,
    softcap, a mask of another rank) runs ``original``."""
    if (dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or (attention_mask is not None and attention_mask.dim() != 4) or query.dim() != 4
            or key.shape[1] == 0 or query.shape[1] % key.shape[1]):
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = attention(query, key, value, attention_mask, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class AttentionRouter:
    """Stands for a modeling module's ``ALL_ATTENTION_FUNCTIONS``: ``"sdpa"`` is the pack's while ``active()``,
    everything else is the registry's."""

    def __init__(self, interface: Any, active: Callable[[], bool]) -> None:
        self._interface = interface
        self._active = active
        self._original = interface["sdpa"] if "sdpa" in interface else None
        self._sdpa = partial(sdpa, self._original)  # made once: compiled graphs see one object every call

    def _route(self, name: str, fn: Callable) -> Callable:
        if name != "sdpa" or fn is not self._original or not self._active():
            return fn
        return self._sdpa

    def get_interface(self, attn_implementation: str, default: Callable) -> Callable:
        return self._route(attn_implementation, self._interface.get_interface(attn_implementation, default))

    def __getitem__(self, name: str) -> Callable:
        return self._route(name, self._interface[name])

    def __contains__(self, name: object) -> bool:
        return name in self._interface

    def __iter__(self):
        return iter(self._interface)

    def __len__(self) -> int:
        return len(self._interface)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._interface, name)


def _attentions(model: nn.Module, family):
    kind = family.cls("Attention")
    for name, m in model.named_modules():
        if type(m) is kind:
            yield name, m


FAMILY = FamilyHook(find=_attentions, route=Route("ALL_ATTENTION_FUNCTIONS", AttentionRouter,
                                                  reads="look up its attention function in", what="attention"))
