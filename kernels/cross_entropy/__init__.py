"""Cross-entropy: ``torch.nn.functional.cross_entropy(logits, target, ignore_index=..., reduction=...)``."""

from __future__ import annotations

import torch

from ...registry import call, integer
from . import cpu as _cpu  # noqa: F401  (registers cross_entropy.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import CROSS_ENTROPY


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", softcap: float | None = None) -> torch.Tensor:
    """Same result as ``F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)``;
    logits [N, V], target [N]; reduction ``"mean"`` (over the targets not ignored) or ``"sum"``; with ``softcap``
    the logits are first capped to ``softcap * tanh(logits / softcap)`` (Gemma 2 and 3)."""
    return call(CROSS_ENTROPY, (logits, target),
                (integer(ignore_index), str(reduction), None if softcap is None else float(softcap)))


__all__ = ["CROSS_ENTROPY", "cross_entropy"]
