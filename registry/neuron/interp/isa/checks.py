"""The checks every ``nki.isa`` call of the interpreter makes (partition limit and start, buffers, layouts),
its instruction clock, and the operand conversions the engines share."""

from __future__ import annotations

import functools

import numpy as np

from ..constants import dge_mode, engine, nc_version, oob_mode, reduce_cmd
from ..errors import NkiError
from ..state import current
from ..tensor import NkiTensor

vector_engine, scalar_engine, gpsimd_engine, tensor_engine, sync_engine = (
    engine.vector, engine.scalar, engine.gpsimd, engine.tensor, engine.sync)
"""The engine aliases of nki.isa (the NKI Library passes ``engine=nisa.vector_engine``)."""


def get_nc_version() -> nc_version:
    return nc_version(current().target.gen)


Engine, Cmd, Oob, Dge = engine, reduce_cmd, oob_mode, dge_mode  # the parameters below shadow these names


class NkiInstruction:
    def depends_on(self, *producers) -> NkiInstruction:
        return self


# -- checks -----------------------------------------------------------------------------------------------------


def instruction(fn):
    """One instruction of the program: advances the clock of the launch's memory (live ranges)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        state = current()
        state.memory.tick()
        state.instruction = f"nisa.{fn.__name__}"
        return fn(*args, **kwargs)

    return run


def tensor_of(call: str, name: str, t) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiError(f"nisa.{call}: {name} must be an NKI tensor, got {type(t).__name__}")
    mem = current().memory
    mem.touch(t.storage)
    for index in getattr(t, "indices", ()):
        mem.touch(index)
    return t


def start_partition(call: str, name: str, t: NkiTensor) -> None:
    """ARCH2 "Data streaming": an engine operand occupies contiguous partitions, and one of more than 64
    partitions starts at partition 0, of 33-64 at 0 or 64, of up to 32 at 0, 32, 64 or 96."""
    p = t.partitions()
    rows = t.partition_rows() if t.size else np.zeros(0, np.int64)
    if p and (np.diff(rows) != 1).any():
        raise NkiError(f"nisa.{call}: {name} {t.describe()} does not occupy contiguous partitions (ARCH2: no "
                       "partition striding within one engine access)")
    start = int(rows[0]) if p else 0
    allowed = (0,) if p > 64 else (0, 64) if p > 32 else (0, 32, 64, 96)
    if start not in allowed:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} starts at partition {start}; an engine access of {p} "
                       f"partitions must start at partition {', '.join(map(str, allowed))} (start-partition rule, "
                       "ARCH2 'Data streaming')")


def on_chip(call: str, name: str, t, allowed=("sbuf", "psum")) -> NkiTensor:
    tensor_of(call, name, t)
    if t.buffer not in allowed:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} must be in {' or '.join(a.upper() for a in allowed)}")
    p, limit = t.partitions(), current().target.partitions
    if p > limit:
        raise NkiError(f"nisa.{call}: {name} partition dimension {p} exceeds maximum {limit}")
    if t.ndim < 2:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} needs a partition dim and a free dim")
    start_partition(call, name, t)
    return t


def same_layout(call: str, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
    if a.partitions() != b.partitions() or a.per_partition() != b.per_partition():
        raise NkiError(f"nisa.{call}: {an} {list(a.shape)} and {bn} {list(b.shape)} must have the same partition "
                       "count and the same number of elements per partition")


def floats_of(t: NkiTensor) -> np.ndarray:
    """Values as (partitions, free) float32: the engines cast every input to float32 before arithmetic."""
    return t.read().reshape(t.partitions(), -1).astype(np.float32)


def ints_of(t: NkiTensor) -> np.ndarray:
    """Values as (partitions, free) int64, for GpSimd's native integer arithmetic and bitvec ops."""
    return t.read().reshape(t.partitions(), -1).astype(np.int64)


def put(dst: NkiTensor, values: np.ndarray) -> None:
    dst.write(np.asarray(values).reshape(dst.shape))


def operand(call: str, name: str, x, partitions: int):
    """A compile-time scalar, or a (P, 1) tile broadcast along the free dims."""
    if isinstance(x, NkiTensor):
        if x.partitions() != partitions or x.per_partition() != 1:
            raise NkiError(f"nisa.{call}: {name} tile {list(x.shape)} must be ({partitions}, 1) or a scalar")
        return x.read().reshape(partitions, 1).astype(np.float32)
    if x is None:
        return np.float32(0.0)
    return np.float32(x)


def apply_op(call: str, op, a, b, reverse: bool = False):
    if op is None:
        return a
    if op.binary is None:
        if op.unary is None:
            raise NkiError(f"nisa.{call}: {op!r} is not an ALU op")
        return op.unary(a)
    return op.binary(b, a) if reverse else op.binary(a, b)
