"""Linear cross-entropy: ``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits."""

from __future__ import annotations

import torch

from ...registry import call, integer
from . import cpu as _cpu  # noqa: F401  (registers linear_cross_entropy.cpu_chunks)
from . import nki as _nki  # noqa: F401  (registers linear_cross_entropy.nki_tiled)
from .op import LINEAR_CROSS_ENTROPY


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         softcap: float | None = None) -> torch.Tensor:
    """Same result as ``F.cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=ignore_index,
    reduction=reduction)``, the logits first capped to ``softcap * tanh(logits / softcap)`` where ``softcap`` is
    given; hidden [N, H], weight [V, H], bias [V], target [N]. On the kernel path the [N, V] logits never exist."""
    return call(LINEAR_CROSS_ENTROPY, (hidden, weight, target, bias),
                (integer(ignore_index), str(reduction), None if softcap is None else float(softcap)))


__all__ = ["LINEAR_CROSS_ENTROPY", "linear_cross_entropy"]
