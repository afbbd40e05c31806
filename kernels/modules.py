"""The kernel pack in any PyTorch model: its ``torch.nn`` modules an op's folder names (its ``hooks.py``'s
``MODULE``: ``torch.nn.RMSNorm``, ``torch.nn.Embedding``), one instance at a time (a hand-written Llama,
torchtitan's models, anything built from ``torch.nn``).

    from nki_autotune.kernels import patch_modules
    patch_modules(model)   # {"embedding": 1, "rmsnorm": 5}

As ``nki_autotune.kernels.hf.patch`` does for Hugging Face models: a new forward bound on each matching instance
(matched by exact class; never the class itself, never ``torch.nn.functional``), weights, ``state_dict``, devices
and dtypes untouched, each call site labelled by the module's qualified name; ``unpatch_modules`` restores the
forwards; patching twice changes nothing; a patched model copies and pickles as patched.
"""

from __future__ import annotations

from functools import partial

from torch import nn

from .shared.hooks import ModuleHook, hooks_of, op_keywords, op_signature

HOOKS: dict[str, ModuleHook] = hooks_of("MODULE")
"""Each op's module hook, from its folder."""
OPS = tuple(HOOKS)
"""The ops ``patch_modules`` can bind: those whose folder has a ``MODULE`` hook, in the pack's order."""


class ModuleForward(partial):
    """A forward ``patch_modules`` bound on one module (a partial of the op's forward and the module)."""


def _candidates(model: nn.Module):
    for name, m in model.named_modules():
        for op, hook in HOOKS.items():
            if type(m) is hook.cls and hook.accepts(m):
                yield op, name, m


def _patched_op(module: nn.Module) -> str | None:
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, ModuleForward) and fwd.args[:1] and fwd.args[0] is module:
        return next((op for op, hook in HOOKS.items() if fwd.func is hook.forward), None)
    return None


def patch_modules(model: nn.Module, **ops: bool) -> dict[str, int]:
    """Patch ``model``'s modules that an op's hook matches (``nn.RMSNorm`` normalising over one dim, plain
    ``nn.Embedding`` without max_norm, gradient scaling or sparse gradients) in place, each op a keyword
    (``rmsnorm=False`` leaves those as they are); returns the number of call sites of each op that now run the
    pack. A module with a forward of its own set on the instance (another library's, or ``hf.patch``'s) is refused
    before anything is bound."""
    wanted = op_keywords("nki_autotune.kernels.patch_modules", ops, OPS)
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
        module.forward = ModuleForward(HOOKS[op].forward, module)
    return {op: len(names) for op, names in module_sites(model).items()}


patch_modules.__signature__ = op_signature(OPS)


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


__all__ = ["HOOKS", "OPS", "ModuleForward", "module_sites", "patch_modules", "unpatch_modules"]
