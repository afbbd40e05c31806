"""Where RMSNorm runs in a model: ``torch.nn.RMSNorm`` over one dim, and each Hugging Face family's RMSNorm
(Qwen3's and Gemma 3's per-head ``q_norm``/``k_norm`` and OLMo 2's across all heads too), with the family's
cast order."""

from __future__ import annotations

import torch
from torch import nn

from ..shared.hooks import FamilyHook, ModuleHook, family_forward
from . import rmsnorm


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


MODULE = ModuleHook(nn.RMSNorm, rms_norm_forward, accepts=lambda m: len(m.normalized_shape) == 1)


def rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` and its copies in Mistral, Qwen2 and Qwen3 (also Qwen3's ``q_norm``/``k_norm``).

    Computed in float32 and returned in the dtype transformers returns, as transformers does: a bfloat16 model's
    norm computed in bfloat16 would move its gradients by a few percent (the casts are no-ops in float32)."""
    dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
    return rmsnorm(hidden_states.float(), self.weight.float(), self.variance_epsilon).to(dtype)


def gemma_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``GemmaRMSNorm.forward`` (Gemma 2 and 3 too, Gemma 3's ``q_norm``/``k_norm`` included): the norm of
    ``x.float()`` times ``1 + weight.float()``, cast to x's dtype at the end (Llama casts before the weight)."""
    return rmsnorm(x.float(), self.weight.float(), self.eps, offset=1.0).type_as(x)


def rmsnorm_float32_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Olmo2RMSNorm.forward`` (its norms after attention and the MLP, and its q/k norms across all heads): the
    weight applied in float32, then the result cast to the input's dtype."""
    return rmsnorm(hidden_states.float(), self.weight.float(), self.variance_epsilon).to(hidden_states.dtype)


_FORWARDS = {f.__name__: f for f in (rmsnorm_forward, gemma_rmsnorm_forward, rmsnorm_float32_forward)}


def _norms(model: nn.Module, family):
    norm = family.cls("RMSNorm")
    for name, m in model.named_modules():
        if type(m) is norm and hasattr(m, "eps" if family.gemma else "variance_epsilon"):
            yield name, m


FAMILY = FamilyHook(find=_norms, forwards=tuple(_FORWARDS.values()),
                    bind=family_forward(_FORWARDS, lambda family: family.norm))
