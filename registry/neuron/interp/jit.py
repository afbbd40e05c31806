"""``nki.jit`` and ``nki.simulate`` of the interpreter: launching a kernel on NumPy arrays or torch tensors."""

from __future__ import annotations

import functools
import threading
from typing import Any

import ml_dtypes
import numpy as np

from .. import lnc_configured
from ..limits import simulated_target
from .errors import NkiError
from .state import Launch, Run, active, enter, leave
from .tensor import NkiTensor, wrap


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
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


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
        if active():  # called from a running kernel: inlined, as specialization inlines calls
            return self.fn(*args, **kwargs)
        return _Launch(self.fn, None)(*args, **kwargs)


class _Launch:
    def __init__(self, fn, lnc: int | None):
        self.fn, self.lnc = fn, lnc

    def degree(self) -> int:
        """The LNC degree of the launch. NKI 0.8 (ANN_GRID; EVRF066): a kernel is specialized across every physical
        core of the compiler's LNC, so ``kernel(...)`` needs no grid and takes the configured degree
        (NEURON_LOGICAL_NC_CONFIG, else 1); a grid ``kernel[n](...)`` is kept for compatibility and must match the
        configured degree, if any (NCC_EVRF066)."""
        configured = lnc_configured()
        if self.lnc is None:
            return configured or 1
        if configured is not None and self.lnc != configured:
            raise NkiError(f"kernel {self.fn.__name__!r} is configured with LNC={self.lnc}, but the compiler uses "
                           f"LNC={configured} (NCC_EVRF066: the launch grid must match NEURON_LOGICAL_NC_CONFIG; "
                           "NKI 0.8 needs no grid)")
        return self.lnc

    def __call__(self, *args, **kwargs):
        target = simulated_target()
        lnc = self.degree()
        buffer = "shared_hbm"  # inputs are visible to every program of the launch (nki/get-started/about/lnc.rst)
        inputs: list = []
        kinds: list = []
        converted = [_argument(i, a, buffer, inputs, kinds) for i, a in enumerate(args)]
        named = {k: _argument(k, v, buffer, inputs, kinds) for k, v in kwargs.items()}
        launch = Launch(lnc)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def program(pid: int) -> None:
            run = Run(target, lnc=lnc, program_id=pid, launch=launch)
            prev = enter(run)
            try:
                results[pid] = self.fn(*converted, **named)
                run.memory.check()
            except BaseException as e:  # reported by the launching thread
                errors[pid] = e
            finally:
                launch.end(pid)
                leave(prev)

        if lnc == 1:
            program(0)
        else:  # at once, so that exchanges between programs (nki.lnc.sendrecv) meet
            threads = [threading.Thread(target=program, args=(pid,), name=f"nki-program-{pid}") for pid in range(lnc)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[min(errors)]
        for orig, st, arr in inputs:  # kernels may write their inputs in place: write back
            if st.dirty:
                _write_back(orig, st.data.reshape(arr.shape))
        kind = kinds[0] if kinds else "numpy"
        return _outputs(results.get(0), kind)


def _argument(key: int | str, a: Any, buffer: str, inputs: list, kinds: list) -> Any:
    """A kernel argument (positional or keyword): arrays become HBM tensors (their own copy), tuples are converted
    element by element."""
    try:
        arr, kind = _to_numpy(a)
    except TypeError:
        if isinstance(a, list):
            raise NkiError(f"kernel argument {key} is a list; NKI kernels take tuples, not lists") from None
        if isinstance(a, tuple):
            return tuple(_argument(key, x, buffer, inputs, kinds) for x in a)
        return a
    t = wrap(arr, buffer, f"arg{key}" if isinstance(key, int) else key)
    inputs.append((a, t.storage, arr))
    kinds.append(kind)
    return t


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
    if out.buffer != "shared_hbm" and not out.storage.is_input:
        raise NkiError(f"the kernel returned {out.describe()}; returned tensors must be allocated with "
                       "buffer=nl.shared_hbm (or be an input the kernel wrote in place)")
    return _from_numpy(np.array(out.read()), kind)


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
