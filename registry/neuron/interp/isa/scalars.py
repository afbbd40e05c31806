"""``nki.isa`` run-time scalars (NKI 0.7: ``NkiScalar``, ``scalar_load``/``scalar_store``; the deprecated
registers) and NKI 0.8's deprecated wrappers of the LNC exchanges."""

from __future__ import annotations

import warnings

import numpy as np

from ..constants import engine
from ..errors import NkiError
from ..scalar import NkiScalar, VirtualRegister, runtime_value
from ..tensor import NkiTensor
from .checks import (
    instruction,
    tensor_of,
)

# -- run-time scalars (NKI 0.7: nki.isa.NkiScalar, scalar_load, scalar_store; VirtualRegister and register_*) ----------


def _one(call: str, name: str, t) -> NkiTensor:
    tensor_of(call, name, t)
    if t.size != 1:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} must hold exactly one element")
    if t.buffer == "psum":
        raise NkiError(f"nisa.{call}: {name} must be in SBUF or HBM, not PSUM")
    return t


@instruction
def scalar_load(src) -> NkiScalar:
    """An NkiScalar from a 1x1 nl.int32 or nl.int64 tile in SBUF or HBM (unsigned dtypes are rejected)."""
    _one("scalar_load", "src", src)
    if src.dtype not in ("int32", "int64"):
        raise NkiError(f"nisa.scalar_load: src dtype {src.dtype}; scalars load from nl.int32 or nl.int64 (use the "
                       "signed dtype of the same width)")
    return NkiScalar(int(np.asarray(src.read()).reshape(-1)[0]), src.dtype)


@instruction
def scalar_store(dst, src) -> None:
    _one("scalar_store", "dst", dst)
    if not isinstance(src, NkiScalar):
        raise NkiError(f"nisa.scalar_store: src must be an NkiScalar, got {type(src).__name__}")
    dst.write(np.asarray(src.value("nisa.scalar_store")))


def _deprecated(old: str, new: str) -> None:
    """NKI 0.8 deprecates ``old``: a DeprecationWarning at the kernel's call site (ANN08)."""
    warnings.warn(f"nki.isa.{old} is deprecated in NKI 0.8 and will be removed; use {new} (Neuron 2.34 "
                  "announcement: end of support for NKI VirtualRegister APIs and nki.isa LNC functions)",
                  DeprecationWarning, stacklevel=3)


_REGISTERS = "nki.isa.scalar_load / nki.isa.scalar_store with nki.isa.NkiScalar"


def register_alloc(x: int | None = None) -> VirtualRegister:
    _deprecated("register_alloc", _REGISTERS)
    if x is not None and not isinstance(x, int):
        raise NkiError(f"nisa.register_alloc: x must be None or an int, got {type(x).__name__}")
    return VirtualRegister(x)


def _register(call: str, r) -> VirtualRegister:
    if not isinstance(r, VirtualRegister):
        raise NkiError(f"nisa.{call}: expected a VirtualRegister (nisa.register_alloc), got {type(r).__name__}")
    return r


@instruction
def register_move(dst, src) -> None:
    _deprecated("register_move", _REGISTERS)
    _register("register_move", dst).set(runtime_value(src, "nisa.register_move"))


@instruction
def register_load(dst, src) -> None:
    _deprecated("register_load", _REGISTERS)
    _one("register_load", "src", src)
    _register("register_load", dst).set(int(np.asarray(src.read()).reshape(-1)[0]))


@instruction
def register_store(dst, src) -> None:
    _deprecated("register_store", _REGISTERS)
    _one("register_store", "dst", dst)
    dst.write(np.asarray(_register("register_store", src).value("nisa.register_store")))



# -- NKI 0.8: the LNC exchanges moved to nki.lnc; these are the deprecated wrappers (ANN08) -------------------


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id=None, name=None):
    """Deprecated: nki.lnc.sendrecv (``pipe_id`` is ignored)."""
    _deprecated("sendrecv", "nki.lnc.sendrecv without pipe_id")
    from .. import lnc

    return lnc.sendrecv(src=src, dst=dst, send_to_rank=send_to_rank, recv_from_rank=recv_from_rank, name=name)


def sendrecv_compute(src, dst, send_to_rank, recv_from_rank, reduce_op, name=None):
    """Deprecated: nki.lnc.sendrecv_compute."""
    _deprecated("sendrecv_compute", "nki.lnc.sendrecv_compute")
    from .. import lnc

    return lnc.sendrecv_compute(src=src, dst=dst, send_to_rank=send_to_rank, recv_from_rank=recv_from_rank,
                                reduce_op=reduce_op, name=name)


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Deprecated: nki.lnc.core_barrier."""
    _deprecated("core_barrier", "nki.lnc.core_barrier")
    from .. import lnc

    return lnc.core_barrier(data=data, cores=cores, engine=engine, name=name)
