"""Rotary embedding: transformers applies it in a module-level function of each modeling module
(``apply_rotary_pos_emb``), which the attention's forward looks up when it runs.

While a model of the family is patched, that name holds a router: inside the forward of a patched attention
module it calls ``nk.rope``; anywhere else it calls the original function, so unpatched models compute what
they computed. The original comes back when the family's last patched attention is unpatched or collected.
Which attention is running is a thread-local flag, set by the patched attention's forward around its class's
forward: compiled graphs read it at trace time (no graph break, no guard that changes between steps) and other
threads never see it.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
from torch import nn

from .. import rope
from .families import forward_uses

NAME = "apply_rotary_pos_emb"


class _Inside(threading.local):
    def __init__(self) -> None:
        self.patched_attention = False
        """True while a patched attention's forward runs in this thread."""


_inside = _Inside()
_live: dict[str, dict[int, weakref.finalize]] = {}
"""Per modeling module: its patched attention modules (by id), each with the finalizer that forgets it."""
_routers: dict[str, tuple[Callable, Callable]] = {}
"""Per modeling module: its original function and the router installed in its place."""


def attention_forward(self, *args, **kwargs):
    """The attention class's own forward, with its rotary embedding routed to the pack."""
    outer = _inside.patched_attention
    _inside.patched_attention = True
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _inside.patched_attention = outer


class RoutedForward(partial):
    """``attention_forward`` bound to one attention module. A copy of a patched model (``copy.deepcopy``, or
    unpickled) gets its own, which routes the copy's attention as ``patch`` routes the original's."""

    def __setstate__(self, state: tuple) -> None:
        super().__setstate__(state)
        attention = self.args[0]
        route(sys.modules[type(attention).__module__], attention)


def _router(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args,
                             **kwargs):
        if (args or kwargs or not _inside.patched_attention
                or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3
                or cos.shape[-1] != q.shape[-1]  # a partial rotary embedding (Phi-3's may be): the original's
                or not q.dtype == k.dtype == cos.dtype == sin.dtype):  # OLMo 2's casts back to q's: the original's
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def check_routable(modeling: ModuleType, attention: type) -> None:
    """An error where this transformers moved the rotary embedding out of the attention's reach."""
    if not callable(getattr(modeling, NAME, None)) or not forward_uses(attention, NAME):
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {attention.__qualname__}.forward does not call {modeling.__name__}.{NAME} in "
            f"this transformers version, so its rotary embedding cannot be routed; patch with rope=False")


def route(modeling: ModuleType, attention: nn.Module) -> None:
    """Route ``attention``'s rotary embedding to the pack (installing the router of ``modeling`` if needed)."""
    key = modeling.__name__
    if key not in _routers:
        original = getattr(modeling, NAME)
        _routers[key] = (original, _router(original))
        setattr(modeling, NAME, _routers[key][1])
    live = _live.setdefault(key, {})
    if id(attention) not in live:
        live[id(attention)] = weakref.finalize(attention, _release, key, id(attention))


def unroute(modeling: ModuleType, attention: nn.Module) -> None:
    """Forget ``attention`` (unpatched); with no patched attention of ``modeling`` left, put the original back."""
    fin = _live.get(modeling.__name__, {}).get(id(attention))
    if fin is not None:
        fin.detach()
        _release(modeling.__name__, id(attention))


def _release(key: str, ident: int) -> None:
    """One patched attention of ``key`` is gone (unpatched or collected): the last one restores the original."""
    live = _live.get(key, {})
    live.pop(ident, None)
    if live or key not in _routers:
        return
    original, router = _routers.pop(key)
    modeling = sys.modules[key]
    if getattr(modeling, NAME, None) is router:
        setattr(modeling, NAME, original)
    else:
        warnings.warn(f"{key}.{NAME} was replaced after nki_autotune.kernels.hf.patch and is left as it is; the "
                      f"router it may still call now calls the original everywhere", stacklevel=2)
