"""nki_autotune.kernels.hf: the kernel pack in Hugging Face transformers models, one instance at a time.

    from nki_autotune.kernels.hf import patch
    patch(model)   # {"rmsnorm": 5, "swiglu": 2, "rope": 2, "attention": 2, "cross_entropy": 1,
                   #  "linear_cross_entropy": 1, "embedding": 1}

``patch`` binds new forwards on this model's modules (never on their classes, never on
``torch.nn.functional``), matched by exact class in the families Llama, Mistral, Qwen2 and Qwen3: RMSNorm
modules (Qwen3's per-head ``q_norm``/``k_norm`` too), SiLU-gated MLPs, the rotary embedding of each attention
and its ``sdpa`` attention function (``nk.attention``; other attention implementations are left as they are),
the token embedding, the causal-LM loss (the instance's ``loss_function``) and, in training with labels, the
causal-LM head and its loss as one ``nk.linear_cross_entropy`` call (the instance's ``forward``; its output's
``logits`` is then None: the logits are never made). Weights, ``state_dict``,
devices and dtypes are untouched; each op runs the pack's function, so the switches and tables decide per call
site (labelled by the module's qualified name, e.g. ``model.layers.0.input_layernorm``) between a kernel and
the expression transformers writes. ``unpatch`` restores every forward; patching twice changes nothing.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from functools import partial

from torch import nn

from . import rope as _rope
from .families import Family, UnsupportedModel, families_of, forward_uses
from .forwards import causal_lm_forward, causal_lm_loss, embedding_forward, mlp_forward, rmsnorm_forward
from .rope import check_routable
from .version import SUPPORTED, UnsupportedVersion, check_version

OPS = ("rmsnorm", "swiglu", "rope", "attention", "cross_entropy", "linear_cross_entropy", "embedding")
_FORWARD = {"rmsnorm": rmsnorm_forward, "swiglu": mlp_forward, "embedding": embedding_forward,
            "linear_cross_entropy": causal_lm_forward}
_OP_OF = {f: op for op, f in _FORWARD.items()}


def patch(model: nn.Module, *, rmsnorm: bool = True, swiglu: bool = True, rope: bool = True,
          attention: bool = True, cross_entropy: bool = True, linear_cross_entropy: bool = True,
          embedding: bool = True) -> dict[str, int]:
    """Patch ``model`` in place; returns the number of call sites of each op that now run the pack.
    Every check runs before anything is bound: a refused model is left as it was. ``linear_cross_entropy=False``
    keeps the logits of a training step with labels (the loss then runs ``nk.cross_entropy`` on them)."""
    check_version()
    wanted = {"rmsnorm": rmsnorm, "swiglu": swiglu, "rope": rope, "attention": attention,
              "cross_entropy": cross_entropy, "linear_cross_entropy": linear_cross_entropy, "embedding": embedding}
    todo = []
    routes: dict[int, set[str]] = {}  # per attention module, the ops its forward routes
    for family in families_of(model):
        for op, name, module in _candidates(model, family):
            if op in _patched_ops(module):
                if op in _rope.ROUTES:  # a copy of a patched model: its attention modules are new
                    _rope.route(family.modeling, module)
            elif wanted[op]:
                _check(name, module, op, family)
                if op in _rope.ROUTES:
                    if id(module) not in routes:
                        todo.append(("routes", module, family))
                    routes.setdefault(id(module), set()).add(op)
                else:
                    todo.append((op, module, family))
    for op, module, family in todo:
        if op == "cross_entropy":
            module.loss_function = causal_lm_loss
            continue
        if op == "routes":
            _rope.route(family.modeling, module)
            module.forward = _rope.RoutedForward(_rope.attention_forward, module,
                                                 nki_routes=frozenset(routes[id(module)]))
        elif op == "linear_cross_entropy":  # the class forward's parameter names, read once, here
            params = tuple(p.name for p in list(inspect.signature(type(module).forward).parameters.values())[1:]
                           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY))
            module.forward = partial(causal_lm_forward, module, params)
        else:  # a partial, not a bound method: a patched model pickles and copies (a method pickles by its name)
            module.forward = partial(_FORWARD[op], module)
    return {op: len(names) for op, names in sites(model).items()}


def unpatch(model: nn.Module) -> None:
    """Restore every forward and loss function ``patch`` replaced in ``model``."""
    for _, module in model.named_modules():
        ops = _patched_ops(module)
        if "cross_entropy" in ops:
            del module._loss_function
        if set(ops) - {"cross_entropy"}:
            routed = isinstance(module.forward, _rope.RoutedForward)
            del module.forward
            if routed:
                _rope.unroute(sys.modules[type(module).__module__], module)


def sites(model: nn.Module) -> dict[str, list[str]]:
    """The qualified names of the call sites of each op that run the pack in ``model``."""
    out: dict[str, list[str]] = {op: [] for op in OPS}
    for name, module in model.named_modules():
        for op in _patched_ops(module):
            out[op].append(name or type(module).__name__)
    return out


def _patched_ops(module: nn.Module) -> tuple[str, ...]:
    """The ops whose forward or loss ``patch`` bound on ``module``: none, one, those an attention routes, or a
    causal LM's loss and its forward."""
    ops = ("cross_entropy",) if module.__dict__.get("_loss_function") is causal_lm_loss else ()
    fwd = module.__dict__.get("forward")
    if not (isinstance(fwd, partial) and fwd.args[:1] and fwd.args[0] is module):
        return ops
    if isinstance(fwd, _rope.RoutedForward):
        return ops + tuple(op for op in _rope.ROUTES if op in fwd.routes)
    return ops + ((_OP_OF[fwd.func],) if fwd.func in _OP_OF else ())


def _check(name: str, module: nn.Module, op: str, family: Family) -> None:
    """Only modules that run their class's computation, as this transformers writes it, are patched: a forward
    (or loss function) set on the instance by something else would be lost, and code transformers moved would
    leave the patch a silent no-op."""
    attr = "_loss_function" if op == "cross_entropy" else "forward"
    if attr in module.__dict__:
        raise ValueError(
            f"nki_autotune.kernels.hf.patch: {name or type(module).__name__} has its own {attr.lstrip('_')} set on "
            f"the instance (by another library, e.g. accelerate's hooks or another kernel patch); patch the model "
            f"before it, or pass {op}=False")
    if op in _rope.ROUTES:
        check_routable(family.modeling, type(module), op)
    if op == "cross_entropy" and not forward_uses(type(module), "loss_function"):
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {type(module).__qualname__}.forward does not compute its loss through "
            f"self.loss_function in this transformers version; patch with cross_entropy=False")
    if op == "linear_cross_entropy" and not all(forward_uses(type(module), n) for n in ("lm_head", "loss_function")):
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {type(module).__qualname__}.forward does not compute its logits with "
            f"self.lm_head and its loss with self.loss_function in this transformers version; patch with "
            f"linear_cross_entropy=False")


def _candidates(model: nn.Module, family: Family) -> Iterator[tuple[str, str, nn.Module]]:
    """(op, qualified name, module) of every module of ``model`` that ``family``'s patching matches exactly."""
    from transformers.activations import SiLUActivation
    from transformers.loss.loss_utils import ForCausalLMLoss

    norm, mlp, attention, base, causal_lm = (family.cls(k) for k in ("RMSNorm", "MLP", "Attention", "Model",
                                                                     "ForCausalLM"))
    for name, m in model.named_modules():
        kind = type(m)
        if kind is norm and hasattr(m, "variance_epsilon"):
            yield "rmsnorm", name, m
        elif kind is mlp and type(getattr(m, "act_fn", None)) in (SiLUActivation, nn.SiLU):
            yield "swiglu", name, m
        elif kind is attention:
            yield "rope", name, m
            yield "attention", name, m
        elif kind is base and _plain_embedding(getattr(m, "embed_tokens", None)):
            yield "embedding", f"{name}.embed_tokens".lstrip("."), m.embed_tokens
        elif kind is causal_lm:
            if "_loss_function" in m.__dict__ or m.loss_function is ForCausalLMLoss:
                yield "cross_entropy", name, m
            if type(getattr(m, "lm_head", None)) is nn.Linear:
                yield "linear_cross_entropy", name, m


def _plain_embedding(m: nn.Module | None) -> bool:
    return (type(m) is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq and not m.sparse)


__all__ = ["OPS", "SUPPORTED", "UnsupportedModel", "UnsupportedVersion", "causal_lm_forward", "causal_lm_loss",
           "check_routable", "check_version", "patch", "sites", "unpatch"]
