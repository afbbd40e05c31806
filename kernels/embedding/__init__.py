"""Embedding lookup: ``torch.nn.functional.embedding(ids, weight)``."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers embedding.cpu_gather)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import EMBEDDING


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same result as ``torch.nn.functional.embedding(ids, weight)``."""
    return call(EMBEDDING, (ids, weight), ())


__all__ = ["EMBEDDING", "embedding"]
