"""``nki.jit`` and ``nki.simulate`` of the interpreter: launching a kernel on NumPy arrays or torch tensors."""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

from ....registry.neuron import lnc_configured
from ..limits import simulated_target
from .errors import NkiError
from .state import Run, enter, leave
from .tensor import NkiTensor, Storage, nki_dtype


def _to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """An argument array and its kind ('numpy' or 'torch')."""
    if isinstance(x, np.ndarray):
        return x, "numpy"
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16), "torch"
        return t.contiguous().numpy(), "torch"
    raise TypeError(type(x).__name__)


def _from_numpy(a: np.ndarray, kind: str):
    if kind == "numpy":
        return a
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _check_arg(i: int, x: Any) -> None:
    if isinstance(x, list):
        raise NkiError(f"kernel argument {i} is a list; NKI kernels take tuples, not lists")
    if isinstance(x, tuple):
        for y in x:
            _check_arg(i, y)


class Kernel:
    """A function marked ``@nki.jit``; ``kernel(...)`` or ``kernel[lnc](...)`` runs it here by simulation."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc) -> _Launch:
        if isinstance(lnc, tuple):
            if len(lnc) != 1:
                raise NkiError(f"kernel[{lnc}]: the launch takes one number, the LNC degree (1 or 2); "
                               "multi-dimensional grids are the legacy API")
            lnc = lnc[0]
        if lnc not in (1, 2):
            raise NkiError(f"kernel[{lnc}]: the LNC degree must be 1 or 2")
        return _Launch(self.fn, lnc)

    def __call__(self, *args, **kwargs):
        return _Launch(self.fn, None)(*args, **kwargs)


class _Launch:
    def __init__(self, fn, lnc: int | None):
        self.fn, self.lnc = fn, lnc

    def degree(self) -> int:
        """NKI 0.7 (docs: nki.jit; error NCC_EVRF066): ``kernel(...)`` takes the configured LNC degree
        (NEURON_LOGICAL_NC_CONFIG, else 1); ``kernel[n](...)`` must match the configured degree, if any."""
        configured = lnc_configured()
        if self.lnc is None:
            return configured or 1
        if configured is not None and self.lnc != configured:
            raise NkiError(f"kernel {self.fn.__name__!r} is configured with LNC={self.lnc}, but the compiler uses "
                           f"LNC={configured} (NCC_EVRF066: the launch grid must match NEURON_LOGICAL_NC_CONFIG)")
        return self.lnc

    def __call__(self, *args, **kwargs):
        target = simulated_target()
        lnc = self.degree()
        buffer = "shared_hbm" if lnc > 1 or self.lnc else "hbm"
        converted, inputs, kinds = [], [], []
        for i, a in enumerate(args):
            try:
                arr, kind = _to_numpy(a)
            except TypeError:
                _check_arg(i, a)
                converted.append(a)
                continue
            st = Storage(arr.shape, nki_dtype(arr.dtype), buffer, f"arg{i}", np.array(arr, copy=True))
            t = NkiTensor(st, np.arange(arr.size, dtype=np.int64).reshape(arr.shape))
            converted.append(t)
            inputs.append((a, st, arr))
            kinds.append(kind)
        shared: list = []
        result = None
        for pid in range(lnc):
            run = Run(target, lnc=lnc, program_id=pid, shared=shared)
            prev = enter(run)
            try:
                out = self.fn(*converted, **kwargs)
                run.memory.check()
            finally:
                leave(prev)
            if pid == 0:
                result = out
        for orig, st, arr in inputs:  # kernels may write their inputs in place: write back
            new = st.data.reshape(arr.shape)
            if not np.array_equal(new, arr, equal_nan=True) if new.dtype.kind == "f" else not np.array_equal(new, arr):
                _write_back(orig, new)
        kind = kinds[0] if kinds else "numpy"
        return _outputs(result, kind)


def _write_back(orig, new: np.ndarray) -> None:
    if isinstance(orig, np.ndarray):
        orig[...] = new
    else:
        orig.copy_(_from_numpy(new, "torch").to(orig.device))


def _outputs(out, kind: str):
    if out is None:
        return None
    if isinstance(out, tuple):
        return tuple(_outputs(o, kind) for o in out)
    if not isinstance(out, NkiTensor):
        raise NkiError(f"the kernel returned {type(out).__name__}; return tensors allocated in nl.shared_hbm")
    if out.buffer != "shared_hbm":
        raise NkiError(f"the kernel returned {out.describe()}; returned tensors must be allocated with "
                       "buffer=nl.shared_hbm")
    return _from_numpy(out.read().reshape(out.shape), kind)


def jit(fn=None, **kwargs):
    """Mark a kernel. ``mode=`` is ignored and ``platform_target=`` raises, as in nki 0.3+."""
    if "platform_target" in kwargs:
        raise NkiError("nki.jit(platform_target=...) was removed; set NEURON_PLATFORM_TARGET_OVERRIDE instead")
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def simulate(kernel):
    """Run ``kernel`` (a jit kernel, a ``kernel[lnc]`` launch, or a plain function) on the CPU."""
    if isinstance(kernel, _Launch):
        return kernel
    if isinstance(kernel, Kernel):
        return _Launch(kernel.fn, None)
    return _Launch(kernel, None)
