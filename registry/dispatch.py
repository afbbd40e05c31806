"""The call path: each call of a pack op takes one impl's custom op, or the reference.

The decision depends only on the call's key (``callkey``), the devices of its tensors and the switches in
force (``switches``); ``precedence.resolve`` makes it. It is cached per call signature in eager mode; under
``torch.compile`` it is made once at trace time (``assume_constant_result``), so the graph holds either the
chosen custom op or the reference, with no guard on the tables and no graph break.

With ``NKI_AUTOTUNE_LOG=1`` (or the logger ``nki_autotune.dispatch`` at INFO) each distinct decision is
logged once per process: the key, the path and why, naming the table and entry that decided.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad

from . import recorder, switches
from .callkey import devices_of, key_of_call, raw_of, symbolic
from .op import Op, get_op
from .precedence import COMPILER, Explanation, resolve

log = logging.getLogger("nki_autotune.dispatch")
_cache: dict[tuple, Explanation] = {}
_logged: set[str] = set()


def _log(exp: Explanation) -> None:
    """Log a decision the first time the process takes it (decisions are made once per call signature): where
    ``NKI_AUTOTUNE_LOG=1`` is in force here, or wherever the application set the logger to INFO."""
    line = str(exp)
    forced = switches.settings().log
    if line in _logged or not (forced or log.isEnabledFor(logging.INFO)):
        return
    _logged.add(line)
    if not forced:
        log.info("%s", line)
        return
    # the logger's own level is the application's: left as it is, so logging ends where the variable does
    if not log.handlers and not logging.getLogger().handlers:  # else the application's handlers show it
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("nki-autotune: %(message)s"))
        log.addHandler(handler)
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "%s", (line,), None))


@torch.compiler.assume_constant_result
def decide(op_name: str, raw: tuple, attrs: tuple, grad: bool, generation: int) -> tuple[str, tuple[int, ...]] | None:
    """The choice for one call: None (reference) or (impl, config values). Constant under tracing."""
    k = (op_name, raw, attrs, grad, generation)
    exp = _cache.get(k)
    if exp is None:
        op = get_op(op_name)
        view = switches.view(generation) if generation else switches.current()
        switches.warn_unknown(view)
        exp = resolve(op, key_of_call(op, raw, op.attr_dict(attrs), grad), devices_of(raw), view)
        _cache[k] = exp
        _log(exp)
    return exp.choice


TRANSFORMED = "a torch.func transform or forward-mode AD is active, which the kernels have no rules for"


@torch.compiler.assume_constant_result
def transformed() -> bool:
    """Whether the call runs under a ``torch.func`` transform (grad, vjp, jvp, jacrev, jacfwd, vmap ...) or
    ``torch.autograd.forward_ad``: a kernel's operator has a backward but no forward-mode rule and no functorch
    rule, so there it would drop tangents (a zero derivative, silently) or refuse to run; the expression has both.
    Constant under tracing: Dynamo traces a transformed function under the transform's own levels."""
    return torch._C._functorch.maybe_current_level() is not None or forward_ad._current_level >= 0


def call(op: Op, tensors: tuple, attrs: tuple, fallback: Callable[[], Any] | None = None) -> Any:
    """Run one call of ``op`` on the chosen path. The pack's public functions end here.

    ``fallback`` (a model's hook gives it) computes the same result where no kernel is chosen, in place of the
    reference expression: the model's own code where that is cheaper than the op's expression (a mixture of experts'
    grouped products, where the expression is dense), so switching a kernel off gives the model as it was."""
    raw = raw_of(tensors)
    grad = torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        if transformed():  # transforms: see transformed
            return op.reference(*tensors, *attrs)
        if symbolic(raw, attrs):  # tables speak of static shapes
            return op.reference(*tensors, *attrs) if fallback is None else fallback()
        switches.ready()
        generation = switches.guard.generation  # a plain attribute: the graph guards on it
    else:
        if transformed():  # never a kernel here, so no site of a profile either
            return op.reference(*tensors, *attrs)
        generation = switches.current().generation  # this context's switches
        rec = recorder.active()
        if rec is not None:
            rec.log(op, tensors, raw, attrs, grad)
    choice = decide(op.name, raw, attrs, grad, generation)
    if choice is None:
        return op.reference(*tensors, *attrs) if fallback is None else fallback()
    impl = op.impls[choice[0]]
    out = impl.fwd_op(*tensors, *attrs, *choice[1])
    if op.outputs + impl.saved == 1:
        return out
    return out[0] if op.outputs == 1 else out[:op.outputs]


def explain(op: str | Op, *args: Any, **kwargs: Any) -> Explanation:
    """Which path ``op(*args, **kwargs)`` takes here, and why (the call is not run)."""
    op = get_op(op) if isinstance(op, str) else op
    names = list(op.tensors) + list(op.attrs)
    if len(args) > len(names):
        raise TypeError(f"explain({op.name!r}, ...): {op.name} takes {len(names)} arguments "
                        f"({', '.join(names)}), got {len(args)}")
    bound = dict(zip(names, args))
    for name in kwargs:
        if name not in names:
            raise TypeError(f"explain({op.name!r}, ...): {op.name} has no argument {name!r}; it takes "
                            f"{', '.join(names)}")
        if name in bound:
            raise TypeError(f"explain({op.name!r}, ...): {name} given twice")
    bound.update(kwargs)
    missing = [n for n in op.tensors if n not in bound and n not in op.optional]
    if missing:
        raise TypeError(f"explain({op.name!r}, ...): missing tensor argument(s) {', '.join(missing)}")
    tensors = tuple(bound.get(n) for n in op.tensors)  # an optional tensor not given is None
    absent = [a for a in op.attrs if a not in bound and a not in op.defaults]
    if absent:
        raise TypeError(f"explain({op.name!r}, ...): missing attribute(s) {', '.join(absent)}")
    attrs = {a: bound.get(a, op.defaults.get(a)) for a in op.attrs}
    raw = raw_of(tensors)
    key = key_of_call(op, raw, attrs, torch.is_grad_enabled())
    if transformed():
        return Explanation(op.name, key, COMPILER, None, {}, TRANSFORMED)
    return resolve(op, key, devices_of(raw), switches.current())


recorder.autostart()  # NKI_AUTOTUNE_RECORD: record this whole process
