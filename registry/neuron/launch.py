"""Launching a kernel at the logical-core degree in force: on a neuron device through TorchNeuron, elsewhere
simulated (numerics only).

On the device the call is ``wrap_nki(kernel)(...)``: ``wrap_nki`` is the form ``torch.compile`` can trace (a raw
``@nki.jit`` call is invisible to dispatcher-based tracing; docs: torch/guides/how-to-work-with-nki.rst). Under NKI
0.8 a kernel is specialized across every physical core of the compiler's LNC, so it needs no launch grid (Neuron
2.34; announce-intent-eos-nki-spmd-launch-grid.rst). Under a real nki 0.7 ``kernel(...)`` defaults to LNC=1 and
the compiler rejects a degree other than its own (NCC_EVRF066; trn2 defaults to LNC=2), so there the caller passes
the grid ``[(lnc,)]``, on the ``wrap_nki`` caller: ``wrap_nki(kernel[lnc])`` would be launched at LNC=1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from . import NEURON, logical_cores, nki_release, torchneuron
from .nki import nki


@cache
def _wrapped(wrap_nki: Callable[..., Any], kernel: Any) -> Any:
    return wrap_nki(kernel)


def grid() -> tuple[int] | None:
    """The launch grid a kernel needs: none under NKI 0.8 (the interpreter's release too); ``(lnc,)``, the degree in
    force, under a real nki 0.7."""
    release = nki_release()
    return (logical_cores(),) if release is not None and release < (0, 8) else None


def run(kernel: Any, device: torch.device) -> Callable[..., Any]:
    """``kernel`` launched at the LNC degree in force, for tensors on ``device``."""
    g = grid()
    if device.type == NEURON.device:
        wrap_nki = torchneuron("wrap_nki")
        if wrap_nki is None:
            raise RuntimeError(f"tensors on the {device.type} device, but torch_neuronx has no wrap_nki: install a "
                               "torch-neuronx that documents nki_op and wrap_nki (Neuron 2.33 or later)")
        caller = _wrapped(wrap_nki, kernel)
        return caller if g is None else caller[g]
    return nki.simulate(kernel if g is None else kernel[g[0]])


def strided_rows(*xs: torch.Tensor) -> tuple:
    """Each x (its last dim contiguous; all of one shape) as the kernels read it in place: the span of its memory as
    one flat tensor (a view: no copy), then its leading dims as (size, stride) pairs; the dims collapsed where one
    stride spans two in every x (so all have the same sizes, and the same tiles), dims of size 1 dropped (a
    contiguous x: one pair, (rows, width)). ``tiles.strided_row_tiles`` walks them."""
    shape = xs[0].shape
    leads: list[list[tuple[int, int]]] = [[] for _ in xs]
    for i, n in enumerate(shape[:-1]):
        if n == 1:
            continue
        strides = [x.stride(i) for x in xs]
        if leads[0] and all(lead[-1][1] == s * n for lead, s in zip(leads, strides)):
            for lead, s in zip(leads, strides):
                lead[-1] = (lead[-1][0] * n, s)
        else:
            for lead, s in zip(leads, strides):
                lead.append((n, s))
    out: list = []
    for x, lead in zip(xs, leads):
        span = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) if x.numel() else 0
        out += [x.detach().as_strided((span,), (1,)), tuple(lead) or ((1, x.shape[-1] if x.dim() else 1),)]
    return tuple(out)


def int32_column(index: torch.Tensor) -> torch.Tensor:
    """Integer indices as the [n, 1] int32 column the kernels read; values beyond int32 saturate, so an index out
    of a table stays out of it (and the kernel's bounds check rejects it) instead of wrapping into range."""
    return index.reshape(-1, 1).clamp(-(2**31), 2**31 - 1).to(torch.int32)
