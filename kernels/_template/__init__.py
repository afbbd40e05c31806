"""The op contract by example (docs/adding-an-op.md): ``squared_relu(x) = relu(x) ** 2`` (Primer's activation), a
CPU and an NKI impl. Copy this folder to ``kernels/<op>/``, name the function after the folder, and the pack finds
it: the folder is all a new op touches, besides the README's op table and its own tests. This folder's name starts
with ``_``, so the pack skips it; the tests import it, and every generic test runs it."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers squared_relu.cpu_blocks)
from . import nki as _nki  # noqa: F401  (registers squared_relu.nki_tiled)
from .op import SQUARED_RELU


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """Same result as ``torch.relu(x) ** 2``."""
    return call(SQUARED_RELU, (x,), ())


__all__ = ["SQUARED_RELU", "squared_relu"]
