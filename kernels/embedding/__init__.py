"""Embedding lookup: ``torch.nn.functional.embedding(ids, weight, padding_idx)``."""

from __future__ import annotations

import torch

from ...registry import call, integer
from . import cpu as _cpu  # noqa: F401  (registers embedding.cpu_gather)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import EMBEDDING


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """Same result as ``torch.nn.functional.embedding(ids, weight, padding_idx)``: the weight gradient's row
    ``padding_idx`` (negative counts from the end) stays zero."""
    return call(EMBEDDING, (ids, weight), (None if padding_idx is None else integer(padding_idx),))


__all__ = ["EMBEDDING", "embedding"]
