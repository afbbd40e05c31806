"""A linear layer, ``F.linear(x, weight, bias)``: each pass's product on the faster library at the site."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers linear.cpu_products)
from . import nki as _nki  # noqa: F401  (registers linear.nki_tiled)
from .op import LINEAR


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as ``F.linear(x, weight, bias)``: x [..., in], weight [out, in] (stored either way round), bias
    [out] or None."""
    return call(LINEAR, (x, weight, bias), ())


__all__ = ["LINEAR", "linear"]
