"""Routes: transformers applies the rotary embedding in a module-level function of each modeling module
(``apply_rotary_pos_emb``) and finds its attention function in the module-level registry
``ALL_ATTENTION_FUNCTIONS``; the attention's forward looks both up when it runs. An op whose hook has a ``Route``
(``kernels/shared/hooks.py``) names such a name.

While a model of the family is patched, those names hold routers: inside the forward of a patched attention
module each gives its op's computation, anywhere else the original, so unpatched models compute what they
computed. The originals come back when the family's last patched attention is unpatched or collected. Which ops
the running attention routes is thread-local, set by the patched attention's forward around its class's forward:
compiled graphs read it at trace time (no graph break, no guard that changes between steps) and other threads
never see it.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from functools import cache, partial
from types import ModuleType

from torch import nn

from ..shared.hooks import Route, forward_uses, hooks_of


@cache
def routes() -> dict[str, Route]:
    """The ops a patched attention module can route, each with the name of its modeling module it routes."""
    return {op: hook.route for op, hook in hooks_of("FAMILY").items() if hook.route is not None}


class _Inside(threading.local):
    def __init__(self) -> None:
        self.routes: frozenset[str] = frozenset()
        """The ops the patched attention whose forward runs in this thread routes to the pack."""


_inside = _Inside()
_live: dict[str, dict[int, weakref.finalize]] = {}
"""Per modeling module: its patched attention modules (by id), each with the finalizer that forgets it."""
_routers: dict[str, tuple[dict[str, Callable], dict[str, Callable]]] = {}
"""Per modeling module: its originals and the routers installed in their place, by name."""


def attention_forward(self, *args, nki_routes: frozenset[str] = frozenset(), **kwargs):
    """The attention class's own forward, with the ops ``nki_routes`` names routed to the pack."""
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
        return self.keywords.get("nki_routes", frozenset())

    def __setstate__(self, state: tuple) -> None:
        super().__setstate__(state)
        attention = self.args[0]
        route(sys.modules[type(attention).__module__], attention)


def check_routable(modeling: ModuleType, attention: type, op: str) -> None:
    """An error where this transformers moved the name ``op`` routes out of the attention's reach."""
    r = routes()[op]
    if getattr(modeling, r.name, None) is None or not forward_uses(attention, r.name):
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {attention.__qualname__}.forward does not {r.reads} {modeling.__name__}."
            f"{r.name} in this transformers version, so its {r.what} cannot be routed; patch with {op}=False")


def route(modeling: ModuleType, attention: nn.Module) -> None:
    """Route ``attention``'s names to the pack (installing the routers of ``modeling`` if needed; each routes only
    where the patched attention running names its op)."""
    key = modeling.__name__
    if key not in _routers:
        originals, routers = {}, {}
        for op, r in routes().items():
            original = getattr(modeling, r.name, None)
            if original is not None:
                originals[r.name] = original
                routers[r.name] = r.router(original, partial(_routing, op))
        _routers[key] = (originals, routers)
        for name, router in routers.items():
            setattr(modeling, name, router)
    live = _live.setdefault(key, {})
    if id(attention) not in live:
        live[id(attention)] = weakref.finalize(attention, _release, key, id(attention))


def _routing(op: str) -> bool:
    return op in _inside.routes


def unroute(modeling: ModuleType, attention: nn.Module) -> None:
    """Forget ``attention`` (unpatched); with no patched attention of ``modeling`` left, put the originals back."""
    fin = _live.get(modeling.__name__, {}).get(id(attention))
    if fin is not None:
        fin.detach()
        _release(modeling.__name__, id(attention))


def _release(key: str, ident: int) -> None:
    """One patched attention of ``key`` is gone (unpatched or collected): the last one restores the originals."""
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
