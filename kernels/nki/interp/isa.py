"""``nki.isa`` of the interpreter: dst-first engine calls with their documented semantics and limits.

Engines compute in float32 and cast to the destination dtype (docs: nki.isa, each call's "Data types"); int32
``tensor_tensor`` runs on GpSimd in exact integer arithmetic. Each call checks the partition limit and start
(``ARCH2`` = nki/guides/architecture/trainium_inferentia2_arch.rst, "Data streaming"), the buffers its engine may
read and write, and the shape rules, names itself and the rule in any error, and counts as one instruction of the
program for the live ranges of on-chip memory.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

from . import constants
from .constants import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd
from .errors import NkiError, NkiRangeWarning
from .scalar import NkiScalar, VirtualRegister, runtime_value
from .state import current
from .tensor import Dynamic, NkiTensor, cast, is_float

vector_engine, scalar_engine, gpsimd_engine, tensor_engine, sync_engine = (
    engine.vector, engine.scalar, engine.gpsimd, engine.tensor, engine.sync)
"""The engine aliases of nki.isa (the NKI Library passes ``engine=nisa.vector_engine``)."""


def get_nc_version() -> nc_version:
    return nc_version(current().target.gen)


_Engine, _Cmd, _Oob, _Dge = engine, reduce_cmd, oob_mode, dge_mode  # the parameters below shadow these names


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


def _tensor(call: str, name: str, t) -> NkiTensor:
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


def _on_chip(call: str, name: str, t, allowed=("sbuf", "psum")) -> NkiTensor:
    _tensor(call, name, t)
    if t.buffer not in allowed:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} must be in {' or '.join(a.upper() for a in allowed)}")
    p, limit = t.partitions(), current().target.partitions
    if p > limit:
        raise NkiError(f"nisa.{call}: {name} partition dimension {p} exceeds maximum {limit}")
    if t.ndim < 2:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} needs a partition dim and a free dim")
    start_partition(call, name, t)
    return t


def _same_layout(call: str, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
    if a.partitions() != b.partitions() or a.per_partition() != b.per_partition():
        raise NkiError(f"nisa.{call}: {an} {list(a.shape)} and {bn} {list(b.shape)} must have the same partition "
                       "count and the same number of elements per partition")


def _pf(t: NkiTensor) -> np.ndarray:
    """Values as (partitions, free) float32: the engines cast every input to float32 before arithmetic."""
    return t.read().reshape(t.partitions(), -1).astype(np.float32)


def _pi(t: NkiTensor) -> np.ndarray:
    """Values as (partitions, free) int64, for GpSimd's native integer arithmetic and bitvec ops."""
    return t.read().reshape(t.partitions(), -1).astype(np.int64)


def _put(dst: NkiTensor, values: np.ndarray) -> None:
    dst.write(np.asarray(values).reshape(dst.shape))


def _operand(call: str, name: str, x, partitions: int):
    """A compile-time scalar, or a (P, 1) tile broadcast along the free dims."""
    if isinstance(x, NkiTensor):
        if x.partitions() != partitions or x.per_partition() != 1:
            raise NkiError(f"nisa.{call}: {name} tile {list(x.shape)} must be ({partitions}, 1) or a scalar")
        return x.read().reshape(partitions, 1).astype(np.float32)
    if x is None:
        return np.float32(0.0)
    return np.float32(x)


def _apply(call: str, op, a, b, reverse: bool = False):
    if op is None:
        return a
    if op.binary is None:
        if op.unary is None:
            raise NkiError(f"nisa.{call}: {op!r} is not an ALU op")
        return op.unary(a)
    return op.binary(b, a) if reverse else op.binary(a, b)


# -- data movement -------------------------------------------------------------------------------------------------


@instruction
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src between HBM and SBUF (either way), SBUF and SBUF, HBM and HBM; never PSUM (nki.isa.dma_copy)."""
    _tensor("dma_copy", "dst", dst)
    _tensor("dma_copy", "src", src)
    target = current().target
    for n, t in (("src", src), ("dst", dst)):
        if t.buffer == "psum":
            raise NkiError(f"nisa.dma_copy: {n} {t.describe()} is in PSUM; DMA cannot access PSUM "
                           "(copy it to SBUF with nisa.tensor_copy first)")
        if t.buffer == "sbuf" and t.partitions() > target.partitions:
            raise NkiError(f"nisa.dma_copy: {n} partition dimension {t.partitions()} exceeds maximum 128")
    if dst.size != src.size:
        raise NkiError(f"nisa.dma_copy: dst {list(dst.shape)} and src {list(src.shape)} hold different numbers of "
                       "elements")
    if dge_mode == _Dge.hwdge and target.gen < 3:
        raise NkiError(f"nisa.dma_copy: dge_mode=hwdge needs NeuronCore-v3 or newer, not {target.name} (hardware "
                       "DGE, nki.isa.dma_copy)")
    if dge_mode == _Dge.hwdge and dst.dtype != src.dtype:
        raise NkiError("nisa.dma_copy: dge_mode=hwdge needs equal dtypes (use .view())")
    vector = [n for n, t in (("src", src), ("dst", dst)) if getattr(t, "vector", False)]
    if vector and not target.indirect_dma:
        raise NkiError(f"nisa.dma_copy: {vector[0]} is an indirect (vector_offset) access, which needs descriptors "
                       f"generated at run time: NeuronCore-v3 or newer (trn2, trn3), not {target.name} (indirect-DMA "
                       "rule; nki.isa.dma_copy, trainium2_arch.rst 'Descriptor Generation Engine')")
    if vector and dge_mode == _Dge.hwdge:
        raise NkiError("nisa.dma_copy: hardware DGE does not support indirect DMA (trainium2_arch.rst); use "
                       "dge_mode=swdge or leave it unknown")
    keep = None
    for n, t in (("src", src), ("dst", dst)):
        if isinstance(t, Dynamic) and t.bad_rows().any():
            if oob_mode == _Oob.error:
                raise NkiError(f"nisa.dma_copy: {n} access pattern reaches element {t.first_bad()} outside "
                               f"{t.name or 'the tensor'} of {t._flat().size} elements (oob_mode=error: the "
                               "bounds check of dynamic DMA, nki.isa.dma_copy)")
            rows = ~t.bad_rows()  # skip: whole indirect rows are dropped
            if not t.per_row:
                rows = np.repeat(rows, t.shape[0] if t.ndim else 1)
            keep = rows if keep is None else keep & rows
    _copy(dst, src, keep)
    return NkiInstruction()


def _copy(dst: NkiTensor, src: NkiTensor, keep: np.ndarray | None) -> None:
    """dst = src element by element in row-major order of the views, through float32 where the dtypes differ
    (nki.isa.dma_copy); ``keep``: the partitions (rows of the first dim) to move, the rest skipped."""
    if keep is None:
        vals = src.read()
        if src.dtype != dst.dtype:
            vals = vals.astype(np.float32)
        dst.write(vals.reshape(dst.shape))
        return
    if not keep.any():
        return
    p = len(keep)
    vals = _rows(src, keep).reshape(p, -1)
    if src.dtype != dst.dtype:
        vals = vals.astype(np.float32)
    if isinstance(dst, Dynamic) and dst.per_row:
        for i, row in enumerate(dst.rows(keep)):
            if row is not None:
                row[...] = cast(vals[i].reshape(row.shape), dst.dtype)
        dst.storage.dirty = True
        return
    whole = dst.read().reshape(p, -1).copy()
    whole[keep] = cast(vals[keep], dst.dtype)
    dst.write(whole.reshape(dst.shape))


def _rows(t: NkiTensor, keep: np.ndarray) -> np.ndarray:
    """The values of ``t`` as (len(keep), -1), rows not kept left as zeros (never read out of bounds)."""
    p = len(keep)
    if isinstance(t, Dynamic) and t.per_row:
        per = t.size // max(1, p)
        out = np.zeros((p, per), t.read_dtype())
        for i, row in enumerate(t.rows(keep)):
            if row is not None:
                out[i] = row.reshape(-1)
        return out
    if isinstance(t, Dynamic) and t.bad_rows().any():
        return np.zeros((p, t.size // max(1, p)), t.read_dtype())
    return t.read().reshape(p, -1)


@instruction
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    _on_chip("tensor_copy", "dst", dst)
    _on_chip("tensor_copy", "src", src)
    if engine == _Engine.gpsimd and "psum" in (dst.buffer, src.buffer):
        raise NkiError("nisa.tensor_copy: GpSimd cannot access PSUM")
    _same_layout("tensor_copy", dst, "dst", src, "src")
    v = src.read() if src.dtype == dst.dtype else _pf(src)
    _put(dst, v)
    return NkiInstruction()


# -- compute -------------------------------------------------------------------------------------------------------


def _domain(op, x: np.ndarray) -> np.ndarray:
    """Where finite inputs fall outside ``op``'s documented range (nki.api.shared "Supported Activation Functions":
    log [2^-64, 2^64], sin [-pi, pi], arctan [-pi/2, pi/2], sqrt [2^-116, 2^118], rsqrt [2^-87, 2^97],
    reciprocal +-[2^-42, 2^42]; outside, results are invalid)."""
    dom = getattr(op, "domain", None)
    if dom is None:
        return np.zeros(x.shape, bool)
    lo, hi, symmetric = dom
    v = np.abs(x) if symmetric else x
    with np.errstate(invalid="ignore"):
        return np.isfinite(x) & ((v < lo) | (v > hi))


@instruction
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """dst = op(data * scale + bias); optionally the free-dim sum of the output through the ScalarE accumulator."""
    _on_chip("activation", "dst", dst)
    _on_chip("activation", "data", data)
    _same_layout("activation", dst, "dst", data, "data")
    if getattr(op, "unary", None) is None:
        raise NkiError(f"nisa.activation: {op!r} is not an activation function")
    p = data.partitions()
    x = _pf(data) * _operand("activation", "scale", scale, p)
    if bias is not None:
        if not isinstance(bias, NkiTensor) and current().target.gen < 3:
            raise NkiError("nisa.activation: a scalar bias needs NeuronCore-v3 or later; pass a (P, 1) tile")
        x = x + _operand("activation", "bias", bias, p)
    with np.errstate(all="ignore"):
        out = op.unary(x).astype(np.float32)
    bad = _domain(op, x)
    if bad.any():
        lo, hi, sym = op.domain
        warnings.warn(f"nisa.activation: {int(bad.sum())} input(s) of {op!r} outside its documented range "
                      f"{'+-' if sym else ''}[{lo:g}, {hi:g}] (activation-range rule, nki.api.shared): invalid on "
                      "hardware, NaN here", NkiRangeWarning, stacklevel=3)
        out[bad] = np.nan
    if reduce_op is not None and getattr(reduce_op, "name", "") != "add":
        raise NkiError(f"nisa.activation: reduce_op must be nl.add, got {reduce_op!r}")
    run = current()
    first = int(data.partition_rows()[0])
    lanes = slice(first, first + p)
    acc, defined = run.act_acc[lanes], run.act_defined[lanes]
    if reduce_cmd in (_Cmd.reset, _Cmd.reset_reduce):
        acc[:] = 0.0
        defined[:] = True
    if reduce_cmd in (_Cmd.reduce, _Cmd.reset_reduce, _Cmd.load_reduce):
        if reduce_op is None:
            raise NkiError(f"nisa.activation: reduce_cmd={reduce_cmd.name} needs reduce_op=nl.add")
        acc += out.sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
        _on_chip("activation", "reduce_res", reduce_res)
        if reduce_res.partitions() != p or reduce_res.per_partition() != 1:
            raise NkiError(f"nisa.activation: reduce_res {list(reduce_res.shape)} must be ({p}, 1)")
        if reduce_res.overlaps(dst):
            raise NkiError("nisa.activation: reduce_res overlaps dst; the instruction writes both, in an order the "
                           "docs leave open (reduce_res-alias rule): give reduce_res its own tile")
    if reduce_cmd in (_Cmd.reduce, _Cmd.load_reduce) or (reduce_res is not None and reduce_cmd == _Cmd.idle):
        if not defined.all():
            raise NkiError(f"nisa.activation: reduce_cmd={reduce_cmd.name} reads the ScalarE accumulator of lanes "
                           "never reset in this kernel; its value is undefined on hardware (accumulator rule, "
                           "nki.isa.activation 'Accumulator behavior'): start with reduce_cmd=reset_reduce")
    if reduce_res is not None:
        _put(reduce_res, acc.reshape(p, 1))
    _put(dst, out)
    return NkiInstruction()


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                      reduce_cmd=_Cmd.reset_reduce)


@instruction
def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    _on_chip("tensor_reduce", "dst", dst)
    _on_chip("tensor_reduce", "data", data)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = data.ndim
    axes = tuple(a % nd for a in axes)
    if 0 in axes:
        raise NkiError("nisa.tensor_reduce: cannot reduce the partition dim (axis 0); use nc_matmul or "
                       "tensor_partition_reduce")
    if sorted(axes) != list(range(nd - len(axes), nd)):
        raise NkiError(f"nisa.tensor_reduce: axis {axis} must be the last free dims of a rank-{nd} tensor")
    if not getattr(op, "reduce", False):
        raise NkiError(f"nisa.tensor_reduce: {op!r} is not a reduction op")
    v = data.read().astype(np.float32).reshape(data.shape)
    funcs = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}
    if op.name in funcs:
        r = funcs[op.name](v, axis=axes)
    else:
        r = v
        for a in sorted(axes, reverse=True):
            r = np.apply_along_axis(lambda s: _fold(op, s), a, r)
    r = np.asarray(r, np.float32)
    if negate:
        r = -r
    if r.size != dst.size or dst.partitions() != data.partitions():
        per = r.size // max(1, data.partitions())
        raise NkiError(f"nisa.tensor_reduce: dst {list(dst.shape)} does not hold the {per} reduced elements "
                       "per partition")
    _put(dst, r)
    return NkiInstruction()


def _fold(op, s):
    acc = s[0]
    for x in s[1:]:
        acc = op.binary(acc, x)
    return acc


_INT32 = ("int32", "uint32")


@instruction
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """op(data1, data2) elementwise. Float (or mixed) operands: float32 math on VectorE; all int32/uint32 and none
    in PSUM: GpSimd's native integer arithmetic, exact (nki.isa.tensor_tensor, "Data types")."""
    for n, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _on_chip("tensor_tensor", n, t)
    if data1.shape != data2.shape and (data1.partitions() != data2.partitions()
                                       or data1.per_partition() != data2.per_partition()):
        raise NkiError(f"nisa.tensor_tensor: data1 {list(data1.shape)} and data2 {list(data2.shape)} differ; no "
                       "broadcasting (use tensor_scalar for a (P, 1) operand)")
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise NkiError("nisa.tensor_tensor: data1 and data2 cannot both be in PSUM")
    _same_layout("tensor_tensor", dst, "dst", data1, "data1")
    tiles = (dst, data1, data2)
    gpsimd = engine == _Engine.gpsimd or (engine == _Engine.unknown and all(t.dtype in _INT32 for t in tiles))
    if gpsimd and any(t.buffer == "psum" for t in tiles):
        if engine == _Engine.gpsimd:
            raise NkiError("nisa.tensor_tensor: GpSimd cannot access PSUM")
        gpsimd = False  # the automatic GpSimd dispatch falls back to VectorE
    if op.bitvec:
        r = op.binary(_pi(data1), _pi(data2))
    elif gpsimd and all(t.dtype in _INT32 for t in tiles):
        with np.errstate(all="ignore"):
            r = op.binary_exact(_pi(data1), _pi(data2))
        bits = 32
        r = (r + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1)) if dst.dtype == "int32" else r % (1 << bits)
    else:
        r = _apply("tensor_tensor", op, _pf(data1), _pf(data2))
    _put(dst, r)
    return NkiInstruction()


@instruction
def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    _on_chip("tensor_scalar", "dst", dst)
    _on_chip("tensor_scalar", "data", data)
    _same_layout("tensor_scalar", dst, "dst", data, "data")
    t = current().target
    if engine == _Engine.scalar and t.gen <= 3 and any(op is not None and op.name not in ("multiply", "add")
                                                        for op in (op0, op1)):
        raise NkiError(f"nisa.tensor_scalar: engine=scalar on {t.name} supports only multiply and add (op0="
                       f"{op0.name}{'' if op1 is None else ', op1=' + op1.name})")
    p = data.partitions()
    if op0.bitvec or (op1 is not None and op1.bitvec):
        if not (op0.bitvec and (op1 is None or op1.bitvec)):
            raise NkiError("nisa.tensor_scalar: op0 and op1 must both be bitvec or both arithmetic")
        r = _apply("tensor_scalar", op0, _pi(data), np.int64(operand0), reverse0)
        if op1 is not None:
            r = _apply("tensor_scalar", op1, r, np.int64(operand1), reverse1)
    else:
        r = _apply("tensor_scalar", op0, _pf(data), _operand("tensor_scalar", "operand0", operand0, p), reverse0)
        if op1 is not None:
            r = _apply("tensor_scalar", op1, r, _operand("tensor_scalar", "operand1", operand1, p), reverse1)
    _put(dst, r)
    return NkiInstruction()


@instruction
def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    for n, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        _on_chip("scalar_tensor_tensor", n, t)
    _same_layout("scalar_tensor_tensor", dst, "dst", data, "data")
    _same_layout("scalar_tensor_tensor", operand1, "operand1", data, "data")
    p = data.partitions()
    r = _apply("scalar_tensor_tensor", op0, _pf(data), _operand("scalar_tensor_tensor", "operand0", operand0, p),
               reverse0)
    r = _apply("scalar_tensor_tensor", op1, r, _pf(operand1), reverse1)
    _put(dst, r)
    return NkiInstruction()


@instruction
def reciprocal(dst, data, name=None):
    _on_chip("reciprocal", "dst", dst)
    _on_chip("reciprocal", "data", data)
    _same_layout("reciprocal", dst, "dst", data, "data")
    with np.errstate(divide="ignore"):
        _put(dst, np.float32(1.0) / _pf(data))
    return NkiInstruction()


@instruction
def memset(dst, value, engine=engine.unknown, name=None):
    _on_chip("memset", "dst", dst)
    if not is_float(dst.dtype) and not isinstance(value, (int, np.integer)):
        raise NkiError(f"nisa.memset: value {value!r} does not match the integer dtype {dst.dtype} of dst (an int "
                       "constant for an integer dst)")
    if engine == _Engine.gpsimd and dst.buffer == "psum":
        raise NkiError("nisa.memset: GpSimd cannot access PSUM")
    _put(dst, np.full(dst.shape, value, np.float32 if is_float(dst.dtype) else np.int64))
    return NkiInstruction()


def _affine(call: str, dst: NkiTensor, pattern, offset: int, channel_multiplier: int) -> np.ndarray:
    counts = [int(c) for _, c in pattern]
    if int(np.prod(counts)) != dst.per_partition():
        raise NkiError(f"nisa.{call}: pattern counts {counts} do not cover the {dst.per_partition()} elements per "
                       "partition of dst")
    v = np.full([dst.partitions(), *counts], offset, np.int64)
    v = v + channel_multiplier * np.arange(dst.partitions()).reshape([-1] + [1] * len(counts))
    for axis, (step, count) in enumerate(pattern):
        shape = [1] * (len(counts) + 1)
        shape[axis + 1] = count
        v = v + int(step) * np.arange(count).reshape(shape)
    return v.reshape(dst.partitions(), -1)


@instruction
def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    _on_chip("iota", "dst", dst, allowed=("sbuf",))
    _put(dst, _affine("iota", dst, pattern, offset, channel_multiplier).astype(np.int32))
    return NkiInstruction()


@instruction
def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    _on_chip("affine_select", "dst", dst, allowed=("sbuf",))
    _on_chip("affine_select", "on_true_tile", on_true_tile, allowed=("sbuf",))
    _same_layout("affine_select", dst, "dst", on_true_tile, "on_true_tile")
    v = _affine("affine_select", dst, pattern, offset, channel_multiplier).astype(np.float32)
    cond = (cmp_op.binary(v, np.float32(0)) if cmp_op is not None else (v == 0)) != 0
    _put(dst, np.where(cond, _pf(on_true_tile), np.float32(on_false_value)))
    return NkiInstruction()


# -- TensorE -------------------------------------------------------------------------------------------------------


MATMUL_INPUTS = ("float8_e4m3", "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32")


def _bank_check(call: str, dst: NkiTensor, n_max: int) -> None:
    """A matmul output lies within one PSUM bank; where the target's largest N fills more than a bank (v4: 4096
    float32), within that many banks from a bank boundary."""
    t = current().target
    item = dst.storage.data.itemsize
    span = max(t.psum_bank_bytes, n_max * item)
    lo, hi = dst.free_extent()
    if dst.size and (lo * item) // span != (hi * item) // span:
        what = "one PSUM bank" if span == t.psum_bank_bytes else f"{span // t.psum_bank_bytes} PSUM banks"
        raise NkiError(f"nisa.{call}: dst {dst.describe()} spans more than {what} ({span} bytes per partition "
                       f"on {t.name}); keep each matmul output within it")


@instruction
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N], float32 accumulation in PSUM."""
    t = current().target
    _on_chip("nc_matmul", "stationary", stationary, allowed=("sbuf",))
    _on_chip("nc_matmul", "moving", moving, allowed=("sbuf",))
    _on_chip("nc_matmul", "dst", dst, allowed=("psum",))
    k, m = stationary.partitions(), stationary.per_partition()
    k2, n = moving.partitions(), moving.per_partition()
    if k != k2:
        raise NkiError(f"nisa.nc_matmul: stationary has K={k} partitions and moving K={k2}; they must match")
    if k > t.matmul_k:
        raise NkiError(f"nisa.nc_matmul: contraction K={k} exceeds maximum {t.matmul_k}")
    if m > t.matmul_m:
        raise NkiError(f"nisa.nc_matmul: stationary free size M={m} exceeds maximum {t.matmul_m}")
    n_max = t.matmul_n_bf16 if dst.dtype == "bfloat16" else t.matmul_n_fp32
    if n > n_max:
        raise NkiError(f"nisa.nc_matmul: moving free size N={n} exceeds maximum {n_max} on {t.name}")
    if dst.dtype not in ("float32",) + (("bfloat16",) if t.gen >= 4 else ()):
        raise NkiError(f"nisa.nc_matmul: dst dtype {dst.dtype} not allowed on {t.name} (float32"
                       + (" or bfloat16)" if t.gen >= 4 else ")"))
    fp32 = {"float32", "tfloat32"}
    for role, operand in (("stationary", stationary), ("moving", moving)):
        if operand.dtype not in MATMUL_INPUTS:
            raise NkiError(f"nisa.nc_matmul: {role} dtype {operand.dtype} is not a TensorE input (one of "
                           f"{', '.join(MATMUL_INPUTS)})")
    if (stationary.dtype in fp32) != (moving.dtype in fp32):
        raise NkiError(f"nisa.nc_matmul: stationary {stationary.dtype} and moving {moving.dtype}: if one is "
                       "float32/tfloat32 both must be")
    if dst.partitions() != m or dst.per_partition() != n:
        raise NkiError(f"nisa.nc_matmul: dst {list(dst.shape)} must be [M={m}, N={n}]")
    _bank_check("nc_matmul", dst, n_max)
    res = _pf(stationary).T.astype(np.float32) @ _pf(moving).astype(np.float32)
    written = dst.mirror(dst.storage.written).reshape(m, n)
    if accumulate is True and not written.all():
        warnings.warn("nisa.nc_matmul: accumulate=True into PSUM that was never written (undefined on hardware)",
                      stacklevel=2)
    if accumulate is True:
        res = np.nan_to_num(_pf(dst), nan=0.0) * written + res if not written.all() else _pf(dst) + res
    elif accumulate is None:
        res = np.where(written, _pf(dst) + res, res)
    _put(dst, res)
    return NkiInstruction()


@instruction
def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F]: TensorE (SBUF -> PSUM, up to 128 x 128) or VectorE (up to 32 x 32)."""
    _on_chip("nc_transpose", "data", data)
    _on_chip("nc_transpose", "dst", dst)
    p, f = data.partitions(), data.per_partition()
    use_vector = engine == _Engine.vector or (engine == _Engine.unknown and dst.buffer != "psum")
    if use_vector:
        if p > 32 or f > 32:
            raise NkiError(f"nisa.nc_transpose: VectorE transposes at most 32 x 32, got {p} x {f}")
    else:
        if data.buffer != "sbuf" or dst.buffer != "psum":
            raise NkiError("nisa.nc_transpose: TensorE reads SBUF and writes PSUM")
        if p > 128 or f > 128:
            raise NkiError(f"nisa.nc_transpose: TensorE transposes at most 128 x 128, got {p} x {f}")
    if dst.partitions() != f or dst.per_partition() != p:
        raise NkiError(f"nisa.nc_transpose: dst {list(dst.shape)} must be [{f}, {p}]")
    if dst.dtype != data.dtype:
        raise NkiError(f"nisa.nc_transpose: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    _put(dst, data.read().reshape(p, f).T)
    return NkiInstruction()


# -- run-time scalars (NKI 0.7: nki.isa.NkiScalar, scalar_load, scalar_store; VirtualRegister and register_*) ----------


def _one(call: str, name: str, t) -> NkiTensor:
    _tensor(call, name, t)
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
    from . import lnc

    return lnc.sendrecv(src=src, dst=dst, send_to_rank=send_to_rank, recv_from_rank=recv_from_rank, name=name)


def sendrecv_compute(src, dst, send_to_rank, recv_from_rank, reduce_op, name=None):
    """Deprecated: nki.lnc.sendrecv_compute."""
    _deprecated("sendrecv_compute", "nki.lnc.sendrecv_compute")
    from . import lnc

    return lnc.sendrecv_compute(src=src, dst=dst, send_to_rank=send_to_rank, recv_from_rank=recv_from_rank,
                                reduce_op=reduce_op, name=name)


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Deprecated: nki.lnc.core_barrier."""
    _deprecated("core_barrier", "nki.lnc.core_barrier")
    from . import lnc

    return lnc.core_barrier(data=data, cores=cores, engine=engine, name=name)


# -- calls the NKI Library uses --------------------------------------------------------------------------------

_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
"""nki.isa.dma_transpose: the permutation by rank, and the only axes supported."""


@instruction
def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """dst = src transposed by the DMA engine (nki.isa.dma_transpose): 2-d (1, 0), 3-d (2, 1, 0), 4-d
    (3, 1, 2, 0); src in HBM or SBUF, dst in SBUF, of the same rank; ``dge_mode=hwdge`` (NeuronCore-v3+) needs
    src.shape[0] == 16, src.shape[-1] % 128 == 0 and a 2-byte dtype."""
    _tensor("dma_transpose", "dst", dst)
    _tensor("dma_transpose", "src", src)
    if src.buffer == "psum" or dst.buffer != "sbuf":
        raise NkiError(f"nisa.dma_transpose: src {src.describe()} must be in HBM or SBUF and dst {dst.describe()} in "
                       "SBUF")
    if dst.ndim != src.ndim:
        raise NkiError(f"nisa.dma_transpose: dst rank {dst.ndim} must equal src rank {src.ndim}")
    want = _TRANSPOSE_AXES.get(src.ndim)
    if want is None or (axes is not None and tuple(axes) != want):
        raise NkiError(f"nisa.dma_transpose: axes {axes} of a rank-{src.ndim} src; supported: (1, 0), (2, 1, 0), "
                       "(3, 1, 2, 0)")
    if dge_mode == _Dge.hwdge:
        if current().target.gen < 3:
            raise NkiError("nisa.dma_transpose: dge_mode=hwdge needs NeuronCore-v3 or newer")
        if src.shape[0] != 16 or src.shape[-1] % 128 or src.itemsize != 2:
            raise NkiError(f"nisa.dma_transpose: dge_mode=hwdge needs src.shape[0] == 16, src.shape[-1] % 128 == 0 "
                           f"and a 2-byte dtype; src is {list(src.shape)} {src.dtype}")
    shape = tuple(src.shape[a] for a in want)
    if tuple(dst.shape) != shape:
        raise NkiError(f"nisa.dma_transpose: dst {list(dst.shape)} must be {list(shape)} (src {list(src.shape)} "
                       f"transposed by {want})")
    vals = np.transpose(src.read(), want)
    dst.write(vals if src.dtype == dst.dtype else vals.astype(np.float32))
    return NkiInstruction()


def _free_reduce(call: str, op, values: np.ndarray) -> np.ndarray:
    """Reduce (P, F) float32 values over the free axis with an ALU op."""
    funcs = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}
    fn = funcs.get(getattr(op, "name", ""))
    if fn is None:
        if getattr(op, "name", "") == "subtract":
            return values[:, :1] - values[:, 1:].sum(axis=1, keepdims=True)
        raise NkiError(f"nisa.{call}: reduce_op {op!r}; supported: nl.add, nl.subtract, nl.multiply, nl.maximum, "
                       "nl.minimum")
    return fn(values, axis=1, keepdims=True).astype(np.float32)


def _reduce_res(call: str, reduce_res, p: int) -> None:
    _on_chip(call, "reduce_res", reduce_res)
    if reduce_res.partitions() != p or reduce_res.per_partition() != 1:
        raise NkiError(f"nisa.{call}: reduce_res {list(reduce_res.shape)} must be ({p}, 1): one element per "
                       "partition")


@instruction
def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """dst = data <op0> operand0 and reduce_res = reduce_op of dst over the free dims, on VectorE
    (nki.isa.tensor_scalar_reduce: one arithmetic op0, no bitvec ops; reduce_op add, multiply, max or min)."""
    _on_chip("tensor_scalar_reduce", "dst", dst)
    _on_chip("tensor_scalar_reduce", "data", data)
    _same_layout("tensor_scalar_reduce", dst, "dst", data, "data")
    if getattr(op0, "bitvec", False):
        raise NkiError(f"nisa.tensor_scalar_reduce: op0 {op0!r} is a bitvec op; only arithmetic ops are supported")
    p = data.partitions()
    r = _apply("tensor_scalar_reduce", op0, _pf(data), _operand("tensor_scalar_reduce", "operand0", operand0, p),
               reverse0)
    r = np.asarray(r, np.float32).reshape(p, -1)
    _put(dst, r)
    if reduce_res is not None:
        _reduce_res("tensor_scalar_reduce", reduce_res, p)
        red = _free_reduce("tensor_scalar_reduce", reduce_op, _pf(dst))
        if reduce_cmd == _Cmd.load_reduce and reduce_init is not None:
            init = _operand("tensor_scalar_reduce", "reduce_init", reduce_init, p)
            red = _free_reduce("tensor_scalar_reduce", reduce_op,
                               np.concatenate([np.broadcast_to(init, (p, 1)), red], axis=1))
        _put(reduce_res, -red if reduce_res_negate else red)
    return NkiInstruction()


@instruction
def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=None, range_start=0, on_false_value=0.0, name=None):
    """dst = on_true_tile where comp_op0(i + range_start, bound0) and comp_op1(i + range_start, bound1) for the
    free index i, else on_false_value; reduce_res = the max over the free dims (nki.isa.range_select, VectorE,
    NeuronCore-v3+; bounds are (P, 1) tiles)."""
    t = current().target
    if t.gen < 3:
        raise NkiError(f"nisa.range_select: available only on NeuronCore-v3 and newer, not {t.name}")
    _on_chip("range_select", "dst", dst)
    _on_chip("range_select", "on_true_tile", on_true_tile)
    _same_layout("range_select", dst, "dst", on_true_tile, "on_true_tile")
    p, f = on_true_tile.partitions(), on_true_tile.per_partition()
    b0 = _operand("range_select", "bound0", bound0, p)
    b1 = _operand("range_select", "bound1", bound1, p)
    idx = np.arange(f, dtype=np.float32)[None, :] + np.float32(range_start)
    cond = (comp_op0.binary(idx, b0) != 0) & (comp_op1.binary(idx, b1) != 0)
    out = np.where(cond, _pf(on_true_tile), np.float32(on_false_value)).astype(np.float32)
    _put(dst, out)
    if reduce_res is not None:
        if reduce_op is not None and getattr(reduce_op, "name", "") != "maximum":
            raise NkiError(f"nisa.range_select: reduce_op {reduce_op!r}; the reduction is nl.maximum")
        _reduce_res("range_select", reduce_res, p)
        _put(reduce_res, _pf(dst).max(axis=1, keepdims=True))
    return NkiInstruction()


@instruction
def tensor_partition_reduce(dst, op, data, name=None):
    """dst[0, ...] = op over the partitions of data, on GpSimd (nki.isa.tensor_partition_reduce: add, max,
    bitwise_or, bitwise_and, bitwise_xor; GpSimd cannot access PSUM)."""
    _on_chip("tensor_partition_reduce", "dst", dst, allowed=("sbuf",))
    _on_chip("tensor_partition_reduce", "data", data, allowed=("sbuf",))
    if dst.partitions() != 1 or dst.per_partition() != data.per_partition():
        raise NkiError(f"nisa.tensor_partition_reduce: dst {list(dst.shape)} must have one partition of the "
                       f"{data.per_partition()} elements per partition of data")
    name_ = getattr(op, "name", "")
    if getattr(op, "bitvec", False) and name_ in ("bitwise_or", "bitwise_and", "bitwise_xor"):
        vals = _pi(data)
        r = vals[0]
        for row in vals[1:]:
            r = op.binary(r, row)
    elif name_ == "add":
        r = _pf(data).sum(axis=0)
    elif name_ == "maximum":
        r = _pf(data).max(axis=0)
    else:
        raise NkiError(f"nisa.tensor_partition_reduce: op {op!r}; supported: nl.add, nl.maximum, nl.bitwise_or, "
                       "nl.bitwise_and, nl.bitwise_xor")
    _put(dst, np.asarray(r).reshape(1, -1))
    return NkiInstruction()


@instruction
def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each quadrant of 32 partitions, dst partition i = src partition shuffle_mask[i] (255: dst partition
    left unchanged), on VectorE (nki.isa.nc_stream_shuffle: same dtype and elements per partition)."""
    _on_chip("nc_stream_shuffle", "dst", dst)
    _on_chip("nc_stream_shuffle", "src", src)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise NkiError(f"nisa.nc_stream_shuffle: shuffle_mask must be 32 partition indices 0-31 (or 255), got {mask}")
    if dst.dtype != src.dtype or dst.per_partition() != src.per_partition():
        raise NkiError(f"nisa.nc_stream_shuffle: dst {list(dst.shape)} {dst.dtype} must have the dtype and the "
                       f"elements per partition of src {list(src.shape)} {src.dtype}")
    p = dst.partitions()
    if p != src.partitions() or (p > 32 and p % 32):
        raise NkiError(f"nisa.nc_stream_shuffle: src and dst access {src.partitions()} and {p} partitions; both the "
                       "same, up to 32 or a multiple of 32")
    vals = src.read().reshape(src.partitions(), -1)
    out = np.array(dst.read()).reshape(p, -1)
    for i in range(p):
        q, j = divmod(i, 32)
        if mask[j] != 255:
            k = q * 32 + mask[j]
            if k >= src.partitions():
                raise NkiError(f"nisa.nc_stream_shuffle: dst partition {i} reads src partition {k}, past the "
                               f"{src.partitions()} accessed")
            out[i] = vals[k]
    dst.write(out.reshape(dst.shape))
    return NkiInstruction()


__all__ = [
    "NkiInstruction", "NkiScalar", "VirtualRegister", "activation", "activation_reduce", "affine_select",
    "constants", "core_barrier", "dge_mode", "dma_copy", "dma_engine", "dma_transpose", "engine", "get_nc_version",
    "gpsimd_engine", "iota",
    "matmul_perf_mode", "memset", "nc_matmul", "nc_stream_shuffle", "nc_transpose", "nc_version", "oob_mode",
    "range_select", "reciprocal", "reduce_cmd", "register_alloc", "register_load", "register_move", "register_store",
    "scalar_engine", "scalar_load", "scalar_store", "scalar_tensor_tensor", "sendrecv", "sendrecv_compute",
    "sync_engine", "tensor_copy", "tensor_engine", "tensor_partition_reduce", "tensor_reduce", "tensor_scalar",
    "tensor_scalar_reduce", "tensor_tensor", "vector_engine",
]
