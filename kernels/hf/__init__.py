"""nki_autotune.kernels.hf: the kernel pack in Hugging Face transformers models, one instance at a time.

    from nki_autotune.kernels.hf import patch
    patch(model)   # {"attention": 2, "cross_entropy": 1, "embedding": 1, "gated_mlp": 2, "geglu": 0, "linear": 8,
                   #  "linear_cross_entropy": 1, "moe_experts": 0, "rmsnorm": 5, "rope": 2, "swiglu": 0}

``patch`` binds new forwards on this model's modules (never on their classes, never on ``torch.nn.functional``),
matched by exact class in the families Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text), Phi-3, OLMo 2,
Granite and SmolLM3: RMSNorm modules (Qwen3's and Gemma 3's per-head ``q_norm``/``k_norm`` and OLMo 2's across all
heads too, each with its family's cast order; Gemma's scale by ``1 + weight``), gated MLPs whole (``gated_mlp``,
Phi-3's fused ``gate_up_proj`` as one weight; with ``gated_mlp=False`` or projection biases: ``swiglu``, Phi-3's
``gate_up_proj`` split in half, and Gemma's GELU(tanh)-gated ``geglu``, their projections ``linear``'s, as the
attention's are), the rotary embedding of each attention that rotates whole heads (not a NoPE layer of SmolLM3, not
a partial rotary embedding) and its ``sdpa`` attention function (``nk.attention``; other attention implementations
are left as they are), the token embedding (Gemma's scaled by sqrt(hidden size)), the causal-LM loss (the instance's
``loss_function``; Gemma 2 and 3 cap their logits before it, so it takes the capped logits) and, in training with
labels, the causal-LM head and its loss as one ``nk.linear_cross_entropy`` call (the instance's ``forward``; its
output's ``logits`` is then None: the logits are never made). What a family computes around them (Granite's
multipliers, OLMo 2's norms after attention and MLP) stays in the forwards the patch leaves as they are; a module
that matches no rule keeps its forward. Weights, ``state_dict``, devices and dtypes are untouched; each op runs the
pack's function, so the switches and tables decide per call site (labelled by the module's qualified name, e.g.
``model.layers.0.input_layernorm``) between a kernel and the expression transformers writes. ``unpatch`` restores
every forward; patching twice changes nothing.

Which modules each op takes, and the forward it binds, is said in the op's folder (``hooks.py``: its ``FAMILY``
hook, ``kernels/shared/hooks.py``); this package walks the hooks of every op the pack finds and keeps what is
common: the families, the version check, the refusals, binding and unbinding, the routes of attention modules.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from torch import nn

from ..shared.hooks import FamilyHook, hooks_of, op_keywords, op_signature
from . import routes as _routes
from .families import FAMILIES, Family, UnsupportedModel, families_of
from .routes import check_routable
from .version import SUPPORTED, UnsupportedVersion, check_version

HOOKS: dict[str, FamilyHook] = hooks_of("FAMILY")
"""Each op's Hugging Face hook, from its folder."""
OPS = tuple(HOOKS)
"""The ops ``patch`` can bind: those whose folder has a ``FAMILY`` hook, in the pack's order."""
KEYWORDS = {hook.keyword or op: op for op, hook in HOOKS.items()}
"""``patch``'s keyword for each op: its name, or the hook's ``keyword`` (``projections``, ``experts``); the op's
name is taken too (``_ALIASES``), as earlier releases took ``moe_experts=``."""
_ALIASES = {op: op for op in HOOKS if op not in KEYWORDS}


def patch(model: nn.Module, **ops: bool) -> dict[str, int]:
    """Patch ``model`` in place; returns the number of call sites of each op that now run the pack. Each op is a
    keyword (``rmsnorm=False`` leaves the model's RMSNorm as it is; ``projections`` is ``linear``'s, ``experts``
    ``moe_experts``'s); every check runs before anything is bound: a
    refused model is left as it was. ``linear_cross_entropy=False`` keeps the logits of a training step with labels
    (the loss then runs ``nk.cross_entropy`` on them)."""
    names = {**KEYWORDS, **_ALIASES}
    given = {names[k]: v for k, v in ops.items() if k in names}
    op_keywords("nki_autotune.kernels.hf.patch", {k: v for k, v in ops.items() if k not in names}, tuple(KEYWORDS))
    wanted = {op: bool(given.get(op, True)) for op in OPS}
    check_version()
    todo = []
    routed: dict[int, set[str]] = {}  # per attention module, the ops its forward routes
    families = families_of(model)
    covered = _covered(model, families, wanted)
    for family in families:
        for op, name, module in _candidates(model, family):
            hook = HOOKS[op]
            if any(name == c or name.startswith(c + ".") for c in covered.get(op, ())):
                continue
            if op in _patched_ops(module):
                if hook.route is not None:  # a copy of a patched model: its attention modules are new
                    _routes.route(family.modeling, module)
            elif wanted[op]:
                _check(name, module, op, family)
                if hook.route is not None:
                    if id(module) not in routed:
                        todo.append((None, module, family))
                    routed.setdefault(id(module), set()).add(op)
                else:
                    todo.append((op, module, family))
    for op, module, family in todo:
        if op is None:
            _routes.route(family.modeling, module)
            module.forward = _routes.RoutedForward(_routes.attention_forward, module,
                                                   nki_routes=frozenset(routed[id(module)]))
        else:
            hook = HOOKS[op]
            module.__dict__[hook.slot] = hook.bind(module, family)
    return {op: len(names) for op, names in sites(model).items()}


patch.__signature__ = op_signature(tuple(KEYWORDS))


def unpatch(model: nn.Module) -> None:
    """Restore every forward and loss function ``patch`` replaced in ``model``."""
    for _, module in model.named_modules():
        slots = {HOOKS[op].slot for op in _patched_ops(module)}
        routed = isinstance(module.__dict__.get("forward"), _routes.RoutedForward)
        for slot in slots:
            del module.__dict__[slot]
        if routed and "forward" in slots:
            _routes.unroute(sys.modules[type(module).__module__], module)


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
    fwd = module.__dict__.get("forward")
    routed = fwd.routes if isinstance(fwd, _routes.RoutedForward) and fwd.args[:1] == (module,) else ()
    return tuple(op for op, hook in HOOKS.items() if (op in routed if hook.route is not None else hook.bound(module)))


def _check(name: str, module: nn.Module, op: str, family: Family) -> None:
    """Only modules that run their class's computation, as this transformers writes it, are patched: a forward
    (or loss function) set on the instance by something else would be lost, and code transformers moved would
    leave the patch a silent no-op."""
    hook = HOOKS[op]
    if hook.slot in module.__dict__:
        raise ValueError(
            f"nki_autotune.kernels.hf.patch: {name or type(module).__name__} has its own {hook.slot.lstrip('_')} set "
            f"on the instance (by another library, e.g. accelerate's hooks or another kernel patch); patch the model "
            f"before it, or pass {hook.keyword or op}=False")
    if hook.route is not None:
        check_routable(family.modeling, type(module), op)
    if hook.check is not None:
        hook.check(module)


def _covered(model: nn.Module, families: list[Family], wanted: dict[str, bool]) -> dict[str, set[str]]:
    """Per op, the modules (qualified names) another op's hook binds, or bound, that cover it (``FamilyHook.covers``):
    the op leaves them and what is inside them alone. A module an earlier patch bound a covered op on (a
    ``gated_mlp=False`` patch's SwiGLU) keeps it: the covering op's own candidate is dropped there."""
    out: dict[str, set[str]] = {}
    for op, hook in HOOKS.items():
        for family in families if hook.covers else ():
            for name, module in hook.find(model, family):
                bound = _patched_ops(module)
                if op in bound or (wanted[op] and not set(bound) & set(hook.covers)):
                    for c in hook.covers:
                        out.setdefault(c, set()).add(name)
                else:
                    out.setdefault(op, set()).add(name)
    return out


def _candidates(model: nn.Module, family: Family) -> Iterator[tuple[str, str, nn.Module]]:
    """(op, qualified name, module) of every module of ``model`` that ``family``'s patching matches exactly."""
    for op, hook in HOOKS.items():
        for name, module in hook.find(model, family):
            yield op, name, module


__all__ = ["FAMILIES", "HOOKS", "KEYWORDS", "OPS", "SUPPORTED", "UnsupportedModel", "UnsupportedVersion",
           "check_routable", "check_version", "patch", "sites", "unpatch"]
