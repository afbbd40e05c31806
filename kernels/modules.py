"""The kernel pack in any PyTorch model: its ``torch.nn.RMSNorm`` and ``torch.nn.Embedding`` modules, one instance at
a time (a hand-written Llama, torchtitan's models, anything built from ``torch.nn``).

    from nki_autotune.kernels import patch_modules
    patch_modules(model)   # {"rmsnorm": 5, "embedding": 1}

As ``nki_autotune.kernels.hf.patch`` does for Hugging Face models: a new forward bound on each matching instance
(matched by exact class; never the class itself, never ``torch.nn.functional``), weights, ``state_dict``, devices
and dtypes untouched, each call site labelled by the module's qualified name; ``unpatch_modules`` restores the
forwards; patching twice changes nothing; a patched model copies and pickles as patched.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .hf.forwards import embedding_forward
from .rmsnorm import rmsnorm

OPS = ("rmsnorm", "embedding")


def rms_norm_forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``nn.RMSNorm.forward`` over the last dim: computed in float32 (float64 for float64 input, or the weight's
    dtype where it is wider), the weight multiplied before the one cast back to x's dtype, eps None the machine
    epsilon of that computation (float32's for bfloat16 input), as ``torch.rms_norm`` does."""
    if not x.is_floating_point():
        return type(self).forward(self, x)  # the error PyTorch gives
    base = torch.float64 if x.dtype == torch.float64 else torch.float32
    eps = torch.finfo(base).eps if self.eps is None else self.eps
    w = self.weight
    c = base if w is None else torch.promote_types(base, w.dtype)
    return rmsnorm(x.to(c), None if w is None else w.to(c), eps).to(x.dtype)


class ModuleForward(partial):
    """A forward ``patch_modules`` bound on one module (a partial of the op's forward and the module)."""


_FORWARD = {"rmsnorm": rms_norm_forward, "embedding": embedding_forward}
_OP_OF = {f: op for op, f in _FORWARD.items()}


def _candidates(model: nn.Module):
    for name, m in model.named_modules():
        kind = type(m)
        if kind is nn.RMSNorm and len(m.normalized_shape) == 1:
            yield "rmsnorm", name, m
        elif kind is nn.Embedding and m.max_norm is None and not m.scale_grad_by_freq and not m.sparse:
            yield "embedding", name, m


def _patched_op(module: nn.Module) -> str | None:
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, ModuleForward) and fwd.args[:1] and fwd.args[0] is module:
        return _OP_OF.get(fwd.func)
    return None


def patch_modules(model: nn.Module, *, rmsnorm: bool = True, embedding: bool = True) -> dict[str, int]:
    """Patch ``model``'s ``nn.RMSNorm`` (normalising over one dim) and plain ``nn.Embedding`` modules (no max_norm,
    gradient scaling or sparse gradients) in place; returns the number of call sites of each op that now run the
    pack. A module with a forward of its own set on the instance (another library's, or ``hf.patch``'s) is refused
    before anything is bound."""
    wanted = {"rmsnorm": rmsnorm, "embedding": embedding}
    todo = []
    for op, name, module in _candidates(model):
        if not wanted[op] or _patched_op(module) == op:
            continue
        if "forward" in module.__dict__:
            raise ValueError(
                f"nki_autotune.kernels.patch_modules: {name or type(module).__name__} has its own forward set on the "
                f"instance (by another library, or nki_autotune.kernels.hf.patch); patch the model before it, or "
                f"pass {op}=False")
        todo.append((op, module))
    for op, module in todo:
        module.forward = ModuleForward(_FORWARD[op], module)
    return {op: len(names) for op, names in module_sites(model).items()}


def unpatch_modules(model: nn.Module) -> None:
    """Restore every forward ``patch_modules`` bound in ``model``."""
    for _, module in model.named_modules():
        if _patched_op(module) is not None:
            del module.forward


def module_sites(model: nn.Module) -> dict[str, list[str]]:
    """The qualified names of the modules of each op that ``patch_modules`` patched in ``model``."""
    out: dict[str, list[str]] = {op: [] for op in OPS}
    for name, module in model.named_modules():
        op = _patched_op(module)
        if op is not None:
            out[op].append(name or type(module).__name__)
    return out


__all__ = ["OPS", "ModuleForward", "module_sites", "patch_modules", "rms_norm_forward", "unpatch_modules"]
