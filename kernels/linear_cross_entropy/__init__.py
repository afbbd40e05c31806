"""Linear cross-entropy: ``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits, with
PyTorch's ``F.linear_cross_entropy`` arguments and Liger's options."""

from __future__ import annotations

import torch

from ...registry import call, integer
from ..shared.loss import LossOutput, accumulation_problem, outputs
from . import cpu as _cpu  # noqa: F401  (registers linear_cross_entropy.cpu_chunks)
from . import nki as _nki  # noqa: F401  (registers linear_cross_entropy.nki_tiled)
from .op import LINEAR_CROSS_ENTROPY


def linear_cross_entropy(hidden: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int | None = -100, reduction: str = "mean",
                         softcap: float | None = None, *, linear_bias: torch.Tensor | None = None,
                         weight: torch.Tensor | None = None, label_smoothing: float = 0.0,
                         lse_square_scale: float = 0.0, return_z_loss: bool = False,
                         return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                         accum_dtype: torch.dtype | None = None, options=None) -> torch.Tensor | LossOutput:
    """Same result as ``F.cross_entropy(F.linear(hidden, linear_weight, bias), target, weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)``; hidden [N, H],
    linear_weight [V, H], bias [V], target [N], class ``weight`` [V]. Called as ``F.linear_cross_entropy`` is
    (``linear_bias``, ``ignore_index=None`` for -100, ``options``: its chunking, which the kernels' tuned chunk
    replaces), with Liger's additions: ``softcap`` (the logits capped to ``softcap * tanh(logits / softcap)``),
    the z-loss ``lse_square_scale`` and what ``return_z_loss``, ``return_token_accuracy`` and
    ``return_predicted_tokens`` ask for (then a ``LossOutput``). ``accum_dtype``: None or float32 (the kernels
    accumulate in float32). On the kernel path the [N, V] logits never exist."""
    accumulation_problem(accum_dtype)
    if bias is not None and linear_bias is not None:
        raise TypeError("linear_cross_entropy: give the bias as bias or as linear_bias, not both")
    bias = linear_bias if bias is None else bias
    attrs = (integer(-100 if ignore_index is None else ignore_index), str(reduction),
             None if softcap is None else float(softcap), float(label_smoothing), float(lse_square_scale),
             bool(return_token_accuracy or return_predicted_tokens))
    tensors = (hidden, linear_weight, target, bias, weight)
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():  # PyTorch raises: so does this
        result = LINEAR_CROSS_ENTROPY.reference(*tensors, *attrs)
    else:
        result = call(LINEAR_CROSS_ENTROPY, tensors, attrs)
    return outputs(result, target, attrs[0], attrs[1], return_z_loss, return_token_accuracy,
                   return_predicted_tokens)


__all__ = ["LINEAR_CROSS_ENTROPY", "LossOutput", "linear_cross_entropy"]
