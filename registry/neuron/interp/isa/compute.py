"""``nki.isa`` on the Vector, Scalar and GpSimd engines: activations, element-wise and scalar ops, reductions,
selects, iota and memset; float32 inside, cast to the destination."""

from __future__ import annotations

import warnings

import numpy as np

from ..constants import engine, reduce_cmd
from ..dtypes import is_float
from ..errors import NkiError, NkiRangeWarning
from ..state import current
from ..tensor import NkiTensor
from .checks import (
    Cmd,
    Engine,
    NkiInstruction,
    apply_op,
    floats_of,
    instruction,
    ints_of,
    on_chip,
    operand,
    put,
    same_layout,
)

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
    on_chip("activation", "dst", dst)
    on_chip("activation", "data", data)
    same_layout("activation", dst, "dst", data, "data")
    if getattr(op, "unary", None) is None:
        raise NkiError(f"nisa.activation: {op!r} is not an activation function")
    p = data.partitions()
    x = floats_of(data) * operand("activation", "scale", scale, p)
    if bias is not None:
        if not isinstance(bias, NkiTensor) and current().target.gen < 3:
            raise NkiError("nisa.activation: a scalar bias needs NeuronCore-v3 or later; pass a (P, 1) tile")
        x = x + operand("activation", "bias", bias, p)
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
    if reduce_cmd in (Cmd.reset, Cmd.reset_reduce):
        acc[:] = 0.0
        defined[:] = True
    if reduce_cmd in (Cmd.reduce, Cmd.reset_reduce, Cmd.load_reduce):
        if reduce_op is None:
            raise NkiError(f"nisa.activation: reduce_cmd={reduce_cmd.name} needs reduce_op=nl.add")
        acc += out.sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
        on_chip("activation", "reduce_res", reduce_res)
        if reduce_res.partitions() != p or reduce_res.per_partition() != 1:
            raise NkiError(f"nisa.activation: reduce_res {list(reduce_res.shape)} must be ({p}, 1)")
        if reduce_res.overlaps(dst):
            raise NkiError("nisa.activation: reduce_res overlaps dst; the instruction writes both, in an order the "
                           "docs leave open (reduce_res-alias rule): give reduce_res its own tile")
    if reduce_cmd in (Cmd.reduce, Cmd.load_reduce) or (reduce_res is not None and reduce_cmd == Cmd.idle):
        if not defined.all():
            raise NkiError(f"nisa.activation: reduce_cmd={reduce_cmd.name} reads the ScalarE accumulator of lanes "
                           "never reset in this kernel; its value is undefined on hardware (accumulator rule, "
                           "nki.isa.activation 'Accumulator behavior'): start with reduce_cmd=reset_reduce")
    if reduce_res is not None:
        put(reduce_res, acc.reshape(p, 1))
    put(dst, out)
    return NkiInstruction()


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                      reduce_cmd=Cmd.reset_reduce)


@instruction
def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    on_chip("tensor_reduce", "dst", dst)
    on_chip("tensor_reduce", "data", data)
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
    put(dst, r)
    return NkiInstruction()


def _fold(op, s):
    acc = s[0]
    for x in s[1:]:
        acc = op.binary(acc, x)
    return acc


INT32 = ("int32", "uint32")


@instruction
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """op(data1, data2) elementwise. Float (or mixed) operands: float32 math on VectorE; all int32/uint32 and none
    in PSUM: GpSimd's native integer arithmetic, exact (nki.isa.tensor_tensor, "Data types")."""
    for n, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        on_chip("tensor_tensor", n, t)
    if data1.shape != data2.shape and (data1.partitions() != data2.partitions()
                                       or data1.per_partition() != data2.per_partition()):
        raise NkiError(f"nisa.tensor_tensor: data1 {list(data1.shape)} and data2 {list(data2.shape)} differ; no "
                       "broadcasting (use tensor_scalar for a (P, 1) operand)")
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise NkiError("nisa.tensor_tensor: data1 and data2 cannot both be in PSUM")
    same_layout("tensor_tensor", dst, "dst", data1, "data1")
    tiles = (dst, data1, data2)
    gpsimd = engine == Engine.gpsimd or (engine == Engine.unknown and all(t.dtype in INT32 for t in tiles))
    if gpsimd and any(t.buffer == "psum" for t in tiles):
        if engine == Engine.gpsimd:
            raise NkiError("nisa.tensor_tensor: GpSimd cannot access PSUM")
        gpsimd = False  # the automatic GpSimd dispatch falls back to VectorE
    if op.bitvec:
        r = op.binary(ints_of(data1), ints_of(data2))
    elif gpsimd and all(t.dtype in INT32 for t in tiles):
        with np.errstate(all="ignore"):
            r = op.binary_exact(ints_of(data1), ints_of(data2))
        bits = 32
        r = (r + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1)) if dst.dtype == "int32" else r % (1 << bits)
    else:
        r = apply_op("tensor_tensor", op, floats_of(data1), floats_of(data2))
    put(dst, r)
    return NkiInstruction()


@instruction
def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    on_chip("tensor_scalar", "dst", dst)
    on_chip("tensor_scalar", "data", data)
    same_layout("tensor_scalar", dst, "dst", data, "data")
    t = current().target
    if engine == Engine.scalar and t.gen <= 3 and any(op is not None and op.name not in ("multiply", "add")
                                                        for op in (op0, op1)):
        raise NkiError(f"nisa.tensor_scalar: engine=scalar on {t.name} supports only multiply and add (op0="
                       f"{op0.name}{'' if op1 is None else ', op1=' + op1.name})")
    p = data.partitions()
    if op0.bitvec or (op1 is not None and op1.bitvec):
        if not (op0.bitvec and (op1 is None or op1.bitvec)):
            raise NkiError("nisa.tensor_scalar: op0 and op1 must both be bitvec or both arithmetic")
        r = apply_op("tensor_scalar", op0, ints_of(data), np.int64(operand0), reverse0)
        if op1 is not None:
            r = apply_op("tensor_scalar", op1, r, np.int64(operand1), reverse1)
    else:
        r = apply_op("tensor_scalar", op0, floats_of(data), operand("tensor_scalar", "operand0", operand0, p), reverse0)
        if op1 is not None:
            r = apply_op("tensor_scalar", op1, r, operand("tensor_scalar", "operand1", operand1, p), reverse1)
    put(dst, r)
    return NkiInstruction()


@instruction
def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    for n, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        on_chip("scalar_tensor_tensor", n, t)
    same_layout("scalar_tensor_tensor", dst, "dst", data, "data")
    same_layout("scalar_tensor_tensor", operand1, "operand1", data, "data")
    p = data.partitions()
    r = apply_op("scalar_tensor_tensor", op0, floats_of(data), operand("scalar_tensor_tensor", "operand0", operand0, p),
               reverse0)
    r = apply_op("scalar_tensor_tensor", op1, r, floats_of(operand1), reverse1)
    put(dst, r)
    return NkiInstruction()


@instruction
def reciprocal(dst, data, name=None):
    on_chip("reciprocal", "dst", dst)
    on_chip("reciprocal", "data", data)
    same_layout("reciprocal", dst, "dst", data, "data")
    with np.errstate(divide="ignore"):
        put(dst, np.float32(1.0) / floats_of(data))
    return NkiInstruction()


@instruction
def memset(dst, value, engine=engine.unknown, name=None):
    on_chip("memset", "dst", dst)
    if not is_float(dst.dtype) and not isinstance(value, (int, np.integer)):
        raise NkiError(f"nisa.memset: value {value!r} does not match the integer dtype {dst.dtype} of dst (an int "
                       "constant for an integer dst)")
    if engine == Engine.gpsimd and dst.buffer == "psum":
        raise NkiError("nisa.memset: GpSimd cannot access PSUM")
    put(dst, np.full(dst.shape, value, np.float32 if is_float(dst.dtype) else np.int64))
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
    on_chip("iota", "dst", dst, allowed=("sbuf",))
    put(dst, _affine("iota", dst, pattern, offset, channel_multiplier).astype(np.int32))
    return NkiInstruction()


@instruction
def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    on_chip("affine_select", "dst", dst, allowed=("sbuf",))
    on_chip("affine_select", "on_true_tile", on_true_tile, allowed=("sbuf",))
    same_layout("affine_select", dst, "dst", on_true_tile, "on_true_tile")
    v = _affine("affine_select", dst, pattern, offset, channel_multiplier).astype(np.float32)
    cond = (cmp_op.binary(v, np.float32(0)) if cmp_op is not None else (v == 0)) != 0
    put(dst, np.where(cond, floats_of(on_true_tile), np.float32(on_false_value)))
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
    on_chip(call, "reduce_res", reduce_res)
    if reduce_res.partitions() != p or reduce_res.per_partition() != 1:
        raise NkiError(f"nisa.{call}: reduce_res {list(reduce_res.shape)} must be ({p}, 1): one element per "
                       "partition")


@instruction
def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """dst = data <op0> operand0 and reduce_res = reduce_op of dst over the free dims, on VectorE
    (nki.isa.tensor_scalar_reduce: one arithmetic op0, no bitvec ops; reduce_op add, multiply, max or min)."""
    on_chip("tensor_scalar_reduce", "dst", dst)
    on_chip("tensor_scalar_reduce", "data", data)
    same_layout("tensor_scalar_reduce", dst, "dst", data, "data")
    if getattr(op0, "bitvec", False):
        raise NkiError(f"nisa.tensor_scalar_reduce: op0 {op0!r} is a bitvec op; only arithmetic ops are supported")
    p = data.partitions()
    r = apply_op("tensor_scalar_reduce", op0, floats_of(data), operand("tensor_scalar_reduce", "operand0", operand0, p),
               reverse0)
    r = np.asarray(r, np.float32).reshape(p, -1)
    put(dst, r)
    if reduce_res is not None:
        _reduce_res("tensor_scalar_reduce", reduce_res, p)
        red = _free_reduce("tensor_scalar_reduce", reduce_op, floats_of(dst))
        if reduce_cmd == Cmd.load_reduce and reduce_init is not None:
            init = operand("tensor_scalar_reduce", "reduce_init", reduce_init, p)
            red = _free_reduce("tensor_scalar_reduce", reduce_op,
                               np.concatenate([np.broadcast_to(init, (p, 1)), red], axis=1))
        put(reduce_res, -red if reduce_res_negate else red)
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
    on_chip("range_select", "dst", dst)
    on_chip("range_select", "on_true_tile", on_true_tile)
    same_layout("range_select", dst, "dst", on_true_tile, "on_true_tile")
    p, f = on_true_tile.partitions(), on_true_tile.per_partition()
    b0 = operand("range_select", "bound0", bound0, p)
    b1 = operand("range_select", "bound1", bound1, p)
    idx = np.arange(f, dtype=np.float32)[None, :] + np.float32(range_start)
    cond = (comp_op0.binary(idx, b0) != 0) & (comp_op1.binary(idx, b1) != 0)
    out = np.where(cond, floats_of(on_true_tile), np.float32(on_false_value)).astype(np.float32)
    put(dst, out)
    if reduce_res is not None:
        if reduce_op is not None and getattr(reduce_op, "name", "") != "maximum":
            raise NkiError(f"nisa.range_select: reduce_op {reduce_op!r}; the reduction is nl.maximum")
        _reduce_res("range_select", reduce_res, p)
        put(reduce_res, floats_of(dst).max(axis=1, keepdims=True))
    return NkiInstruction()


@instruction
def tensor_partition_reduce(dst, op, data, name=None):
    """dst[0, ...] = op over the partitions of data, on GpSimd (nki.isa.tensor_partition_reduce: add, max,
    bitwise_or, bitwise_and, bitwise_xor; GpSimd cannot access PSUM)."""
    on_chip("tensor_partition_reduce", "dst", dst, allowed=("sbuf",))
    on_chip("tensor_partition_reduce", "data", data, allowed=("sbuf",))
    if dst.partitions() != 1 or dst.per_partition() != data.per_partition():
        raise NkiError(f"nisa.tensor_partition_reduce: dst {list(dst.shape)} must have one partition of the "
                       f"{data.per_partition()} elements per partition of data")
    name_ = getattr(op, "name", "")
    if getattr(op, "bitvec", False) and name_ in ("bitwise_or", "bitwise_and", "bitwise_xor"):
        vals = ints_of(data)
        r = vals[0]
        for row in vals[1:]:
            r = op.binary(r, row)
    elif name_ == "add":
        r = floats_of(data).sum(axis=0)
    elif name_ == "maximum":
        r = floats_of(data).max(axis=0)
    else:
        raise NkiError(f"nisa.tensor_partition_reduce: op {op!r}; supported: nl.add, nl.maximum, nl.bitwise_or, "
                       "nl.bitwise_and, nl.bitwise_xor")
    put(dst, np.asarray(r).reshape(1, -1))
    return NkiInstruction()
