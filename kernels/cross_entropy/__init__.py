"""Cross-entropy with PyTorch's options and Liger's: ``F.cross_entropy(logits, target, weight, ...)``, plus the
softcap, the z-loss, the predicted tokens and the token accuracy."""

from __future__ import annotations

import torch

from ...registry import call, integer
from ..shared.loss import LossOutput, accumulation_problem, outputs
from . import cpu as _cpu  # noqa: F401  (registers cross_entropy.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import CROSS_ENTROPY


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean", softcap: float | None = None, *,
                  label_smoothing: float = 0.0, lse_square_scale: float = 0.0, return_z_loss: bool = False,
                  return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                  accum_dtype: torch.dtype | None = None) -> torch.Tensor | LossOutput:
    """Same result as ``F.cross_entropy(logits, target, weight, ignore_index=ignore_index, reduction=reduction,
    label_smoothing=label_smoothing)`` (logits [N, V], target [N], class weights [V]; ``reduction`` ``"mean"``,
    ``"sum"`` or ``"none"``), the logits first capped to ``softcap * tanh(logits / softcap)`` where given (Gemma 2
    and 3), plus ``lse_square_scale`` times the mean (or sum) of the counted tokens' ``logsumexp(logits)^2`` (the
    z-loss). With ``return_z_loss``, ``return_token_accuracy`` or ``return_predicted_tokens`` it returns a
    ``LossOutput``; otherwise the loss. ``accum_dtype``: None or float32 (the kernels accumulate in float32)."""
    accumulation_problem(accum_dtype)
    attrs = (integer(ignore_index), str(reduction), None if softcap is None else float(softcap),
             float(label_smoothing), float(lse_square_scale), bool(return_token_accuracy or return_predicted_tokens))
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():  # PyTorch raises: so does this
        result = CROSS_ENTROPY.reference(logits, target, weight, *attrs)
    else:
        result = call(CROSS_ENTROPY, (logits, target, weight), attrs)
    return outputs(result, target, attrs[0], attrs[1], return_z_loss, return_token_accuracy,
                   return_predicted_tokens)


__all__ = ["CROSS_ENTROPY", "LossOutput", "cross_entropy"]
