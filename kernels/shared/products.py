"""The CPU's matrix products beside torch's BLAS: oneDNN's linear (``mkldnn::_linear_pointwise``), which picks its
kernels by the CPU's instructions (AVX-512, AVX-512 BF16 where there are), where the compiled graph calls MKL's
``mm``. Which is faster depends on the shape and the pass (docs/benchmarks.md): kernels make it a tuned choice.
Where oneDNN does not run a dtype on this CPU (bfloat16 on a CPU without AVX-512: "could not create a primitive
descriptor"), the tuner is offered no oneDNN config for it and a config asking for one runs torch's product."""

from __future__ import annotations

import functools

import torch


def _onednn() -> bool:
    """Whether this torch has oneDNN's linear (in every x86 and Arm CPU build)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._linear_pointwise is not None
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _onednn()


@functools.cache
def serves(dtype: torch.dtype | str) -> bool:
    """Whether oneDNN's linear runs ``dtype`` (a torch dtype or its name) on this CPU: tried once on a 2 x 2."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not ONEDNN:
        return False
    try:
        linear(torch.ones(2, 2, dtype=dtype), torch.ones(2, 2, dtype=dtype))
    except RuntimeError:
        return False
    return True


def allowed(config: dict, passes: tuple[str, ...], dtype: str) -> bool:
    """A config's constraint: oneDNN chosen for none of ``passes``, or oneDNN runs ``dtype`` here."""
    return not any(config[p] for p in passes) or serves(dtype)


def onednn_enabled(config_choice: int | bool) -> bool:
    """A config's ``onednn`` choice, where this torch has it and it is not switched off."""
    return bool(config_choice) and ONEDNN and torch.backends.mkldnn.enabled


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) by oneDNN: a new tensor (oneDNN writes into no given buffer); w stored either way round."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def product(x: torch.Tensor, w: torch.Tensor, onednn: bool, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias), into ``out`` where given: oneDNN's linear (w made row- or column-major where it is
    neither; an empty contraction, or a dtype it does not run here, on torch's) or torch's ``mm``/``addmm``."""
    if onednn and x.shape[-1] > 0 and serves(x.dtype):
        if not (w.is_contiguous() or w.t().is_contiguous()):
            w = w.contiguous()
        y = linear(x, w, None if bias is None else bias.contiguous())
        return y if out is None else out.copy_(y)
    wt = w.t()
    if bias is None:
        return torch.mm(x, wt) if out is None else torch.mm(x, wt, out=out)
    return torch.addmm(bias, x, wt) if out is None else torch.addmm(bias, x, wt, out=out)


def accumulate(acc: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, onednn: bool,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """``acc + x @ w.T`` in place in ``acc``; where ``acc`` is None (a first tile), the product as a float32 tensor,
    new or written into ``into``: sums over tiles of bfloat16 products kept in float32."""
    if acc is None:
        if into is not None and into.dtype == x.dtype:
            return product(x, w, onednn, out=into)
        p = product(x, w, onednn)
        return p.float() if into is None else into.copy_(p)
    if acc.dtype == x.dtype and not onednn:
        return acc.addmm_(x, w.t())
    return acc.add_(product(x, w, onednn))

__all__ = ["ONEDNN", "accumulate", "allowed", "linear", "onednn_enabled", "product", "serves"]
