"""Rotary embedding and attention: transformers applies the rotary embedding in a module-level function of each
modeling module (``apply_rotary_pos_emb``), and finds its attention function in the module-level registry
``ALL_ATTENTION_FUNCTIONS``; the attention's forward looks both up when it runs.

While a model of the family is patched, those names hold routers: inside the forward of a patched attention
module the first calls ``nk.rope`` and the second hands out ``nk.attention`` for ``"sdpa"``
(``hf.attention``); anywhere else they give the originals, so unpatched models compute what they computed. The
originals come back when the family's last patched attention is unpatched or collected. Which ops the running
attention routes is thread-local, set by the patched attention's forward around its class's forward: compiled
graphs read it at trace time (no graph break, no guard that changes between steps) and other threads never see
it.
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

from ..rope import rope
from .attention import INTERFACE, AttentionRouter
from .families import forward_uses

NAME = "apply_rotary_pos_emb"
ROUTES = ("rope", "attention")
"""The ops a patched attention module can route, each through a name of its modeling module."""
_NAMES = {"rope": NAME, "attention": INTERFACE}


class _Inside(threading.local):
    def __init__(self) -> None:
        self.routes: frozenset[str] = frozenset()
        """The ops the patched attention whose forward runs in this thread routes to the pack."""


_inside = _Inside()
_live: dict[str, dict[int, weakref.finalize]] = {}
"""Per modeling module: its patched attention modules (by id), each with the finalizer that forgets it."""
_routers: dict[str, tuple[Callable, Callable]] = {}
"""Per modeling module: its original function and the router installed in its place."""


def attention_forward(self, *args, nki_routes: frozenset[str] = frozenset({"rope"}), **kwargs):
    """The attention class's own forward, with its rotary embedding and/or attention (``nki_routes``) routed to
    the pack."""
    outer = _inside.routes
    _inside.routes = nki_routes
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _inside.routes = outer


class RoutedForward(partial):
    """``attention_forward`` bound to one attention module and the ops it routes. A copy of a patched model
    (``copy.deepcopy``, or unpickled) gets its own, which routes the copy's attention as ``patch`` routes the
    original's."""

    @property
    def routes(self) -> frozenset[str]:
        return self.keywords.get("nki_routes", frozenset({"rope"}))

    def __setstate__(self, state: tuple) -> None:
        super().__setstate__(state)
        attention = self.args[0]
        route(sys.modules[type(attention).__module__], attention)


def _router(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args,
                             **kwargs):
        if (args or kwargs or "rope" not in _inside.routes
                or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3
                or cos.shape[-1] != q.shape[-1]  # a partial rotary embedding (Phi-3's may be): the original's
                or not q.dtype == k.dtype == cos.dtype == sin.dtype):  # OLMo 2's casts back to q's: the original's
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def check_routable(modeling: ModuleType, attention: type, op: str = "rope") -> None:
    """An error where this transformers moved the rotary embedding (``op`` rope) or the attention function
    (``op`` attention) out of the attention's reach."""
    name = _NAMES[op]
    if getattr(modeling, name, None) is None or not forward_uses(attention, name):
        what = "call" if op == "rope" else "look up its attention function in"
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {attention.__qualname__}.forward does not {what} {modeling.__name__}.{name} "
            f"in this transformers version, so its {'rotary embedding' if op == 'rope' else 'attention'} cannot be "
            f"routed; patch with {op}=False")


def route(modeling: ModuleType, attention: nn.Module) -> None:
    """Route ``attention``'s rotary embedding and attention function to the pack (installing the routers of
    ``modeling`` if needed; each routes only the ops the patched attention names)."""
    key = modeling.__name__
    if key not in _routers:
        originals = {NAME: getattr(modeling, NAME)}
        routers = {NAME: _router(originals[NAME])}
        interface = getattr(modeling, INTERFACE, None)
        if interface is not None:
            originals[INTERFACE] = interface
            routers[INTERFACE] = AttentionRouter(interface, lambda: "attention" in _inside.routes)
        _routers[key] = (originals, routers)
        for name, router in routers.items():
            setattr(modeling, name, router)
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
    originals, routers = _routers.pop(key)
    modeling = sys.modules[key]
    for name, router in routers.items():
        if getattr(modeling, name, None) is router:
            setattr(modeling, name, originals[name])
        else:
            warnings.warn(f"{key}.{name} was replaced after nki_autotune.kernels.hf.patch and is left as it is; the "
                          f"router it may still call now calls the original everywhere", stacklevel=2)
