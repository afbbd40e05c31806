"""nki_autotune.kernels.hf: the kernel pack in Hugging Face transformers models, one instance at a time.

    from nki_autotune.kernels.hf import patch
    patch(model)   # {"rmsnorm": 5, "swiglu": 2, "rope": 2, "attention": 2, "cross_entropy": 1,
                   #  "linear_cross_entropy": 1, "embedding": 1}

``patch`` binds new forwards on this model's modules (never on their classes, never on
``torch.nn.functional``), matched by exact class in the families Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
Gemma 3 (text), Phi-3, OLMo 2, Granite and SmolLM3: RMSNorm modules (Qwen3's and Gemma 3's per-head
``q_norm``/``k_norm`` and OLMo 2's across all heads too, each with its family's cast order; Gemma's scale by
``1 + weight``), SiLU-gated MLPs (``swiglu``; Phi-3's fused ``gate_up_proj`` split in half) and Gemma's
GELU(tanh)-gated ones (``geglu``), the rotary embedding of each attention that rotates whole heads (not a NoPE
layer of SmolLM3, not a partial rotary embedding) and its ``sdpa`` attention function (``nk.attention``; other
attention implementations are left as they are), the token embedding (Gemma's scaled by sqrt(hidden size)), the
causal-LM loss (the instance's ``loss_function``; Gemma 2 and 3 cap their logits before it, so it takes the capped
logits) and, in training with labels, the causal-LM head and its loss as one ``nk.linear_cross_entropy`` call (the
instance's ``forward``; its output's ``logits`` is then None: the logits are never made). What a family computes
around them (Granite's multipliers, OLMo 2's norms after attention and MLP) stays in the forwards the patch leaves
as they are; a module that matches no rule keeps its forward. Weights, ``state_dict``, devices and dtypes are
untouched; each op runs the pack's function, so the switches and tables decide per call site (labelled by the
module's qualified name, e.g. ``model.layers.0.input_layernorm``) between a kernel and the expression transformers
writes. ``unpatch`` restores every forward; patching twice changes nothing.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from functools import partial

import torch.nn.functional as F
from torch import nn

from . import forwards as _forwards
from . import rope as _rope
from .families import FAMILIES, Family, UnsupportedModel, families_of, forward_uses
from .forwards import causal_lm_forward, causal_lm_loss, embedding_forward, scaled_embedding_forward
from .rope import check_routable
from .version import SUPPORTED, UnsupportedVersion, check_version

OPS = ("rmsnorm", "swiglu", "geglu", "rope", "attention", "cross_entropy", "linear_cross_entropy", "embedding")
_FORWARD = {"embedding": embedding_forward, "linear_cross_entropy": causal_lm_forward}
_MLP_OP = {"geglu_mlp_forward": "geglu"}
"""The op of a family's MLP forward, where it is not swiglu."""
_OP_OF = {f: op for op, f in _FORWARD.items()}
_OP_OF[scaled_embedding_forward] = "embedding"  # Gemma's ``TextScaledWordEmbedding`` (transformers 5)
_OP_OF.update({getattr(_forwards, f.norm): "rmsnorm" for f in FAMILIES.values()})
_OP_OF.update({getattr(_forwards, f.mlp): _MLP_OP.get(f.mlp, "swiglu") for f in FAMILIES.values()})


def _forward(op: str, module: nn.Module, family: Family):
    """The forward ``patch`` binds for ``op`` on ``module`` of ``family``."""
    if op == "rmsnorm":
        return getattr(_forwards, family.norm)
    if op in ("swiglu", "geglu"):
        return getattr(_forwards, family.mlp)
    if op == "embedding" and type(module) is not nn.Embedding:
        return scaled_embedding_forward
    return _FORWARD[op]


def patch(model: nn.Module, *, rmsnorm: bool = True, swiglu: bool = True, geglu: bool = True, rope: bool = True,
          attention: bool = True, cross_entropy: bool = True, linear_cross_entropy: bool = True,
          embedding: bool = True) -> dict[str, int]:
    """Patch ``model`` in place; returns the number of call sites of each op that now run the pack.
    Every check runs before anything is bound: a refused model is left as it was. ``linear_cross_entropy=False``
    keeps the logits of a training step with labels (the loss then runs ``nk.cross_entropy`` on them)."""
    check_version()
    wanted = {"rmsnorm": rmsnorm, "swiglu": swiglu, "geglu": geglu, "rope": rope, "attention": attention,
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
            # what callers read off the forward (the Trainer keeps the dataset columns it names) stays the class's
            module.forward.__signature__ = inspect.signature(type(module).forward.__get__(module))
        else:  # a partial, not a bound method: a patched model pickles and copies (a method pickles by its name)
            module.forward = partial(_forward(op, module, family), module)
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

    norm, mlp, attention, base, causal_lm, scaled = (
        family.cls(k) for k in ("RMSNorm", "MLP", "Attention", "Model", "ForCausalLM", "TextScaledWordEmbedding"))
    fused = family.mlp == "fused_mlp_forward"
    act, projections = ("activation_fn", ("gate_up_proj",)) if fused else ("act_fn", ("gate_proj", "up_proj"))
    for name, m in model.named_modules():
        kind = type(m)
        if kind is norm and hasattr(m, "eps" if family.gemma else "variance_epsilon"):
            yield "rmsnorm", name, m
        elif (kind is mlp and not family.gemma and type(getattr(m, act, None)) in (SiLUActivation, nn.SiLU)
              and all(isinstance(getattr(m, p, None), nn.Linear) for p in projections)):
            yield "swiglu", name, m
        elif kind is mlp and family.gemma and _gelu_tanh(getattr(m, "act_fn", None)):
            yield "geglu", name, m
        elif kind is attention:
            if _rotates_whole_heads(m):
                yield "rope", name, m
            yield "attention", name, m
        elif kind is base and _plain_embedding(getattr(m, "embed_tokens", None), scaled):
            yield "embedding", f"{name}.embed_tokens".lstrip("."), m.embed_tokens
        elif kind is causal_lm:
            if "_loss_function" in m.__dict__ or m.loss_function is ForCausalLMLoss:
                yield "cross_entropy", name, m
            if family.fused_head and type(getattr(m, "lm_head", None)) is nn.Linear:
                yield "linear_cross_entropy", name, m


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



def _plain_embedding(m: nn.Module | None, scaled: type | None = None) -> bool:
    """An ``nn.Embedding`` (or the family's scaled one, exactly) without max_norm, gradient scaling or sparse
    gradients."""
    return (m is not None and type(m) in (nn.Embedding, scaled) and m.max_norm is None and not m.scale_grad_by_freq
            and not m.sparse)


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


__all__ = ["OPS", "SUPPORTED", "UnsupportedModel", "UnsupportedVersion", "causal_lm_forward", "causal_lm_loss",
           "check_routable", "check_version", "patch", "sites", "unpatch"]
