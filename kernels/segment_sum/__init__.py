"""Segment sum: ``src.new_zeros(num_segments, *src.shape[1:]).index_add_(0, index, src)``."""

from __future__ import annotations

import torch

from ...registry import call, integer
from . import cpu as _cpu  # noqa: F401  (registers segment_sum.cpu_scatter)
from . import nki as _nki  # noqa: F401  (registers the NKI impl)
from .op import SEGMENT_SUM


def segment_sum(src: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Same result as ``src.new_zeros(num_segments, *src.shape[1:]).index_add_(0, index, src)``."""
    return call(SEGMENT_SUM, (src, index), (integer(num_segments),))


__all__ = ["SEGMENT_SUM", "segment_sum"]
