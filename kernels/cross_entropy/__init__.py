"""Cross-entropy: ``torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index)``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers cross_entropy.cpu_rows)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import CROSS_ENTROPY


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Same result as ``F.cross_entropy(logits, target, ignore_index=ignore_index)``; logits [N, V], target [N]."""
    return call(CROSS_ENTROPY, (logits, target), (int(ignore_index),))


__all__ = ["CROSS_ENTROPY", "cross_entropy"]
