"""``nki.isa`` of the interpreter: dst-first engine calls with their documented semantics and limits.

Engines compute in float32 and cast to the destination dtype. Each call checks the
partition limit, the buffers its engine may read and write, and the shape rules,
and names itself in any error.
"""

from __future__ import annotations

import warnings
from enum import Enum

import numpy as np

from .state import NkiError, current
from .tensor import NkiTensor, _Indirect, cast, is_float


class engine(Enum):  # noqa: N801  (the NKI names)
    unknown = 0
    tensor = 1
    vector = 2
    scalar = 3
    gpsimd = 4
    dma = 5
    sync = 6


class reduce_cmd(Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class oob_mode(Enum):  # noqa: N801
    error = 0
    skip = 1


class dge_mode(Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class matmul_perf_mode(Enum):  # noqa: N801
    none = 0
    double_row = 1


class nc_version(Enum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    return nc_version(current().target.gen)


_Engine, _Cmd, _Oob, _Dge = engine, reduce_cmd, oob_mode, dge_mode  # the parameters below shadow these names


class NkiInstruction:
    def depends_on(self, *producers) -> NkiInstruction:
        return self


# -- checks -----------------------------------------------------------------------------------------------------


def _tensor(call: str, name: str, t) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiError(f"nisa.{call}: {name} must be an NKI tensor, got {type(t).__name__}")
    return t


def _on_chip(call: str, name: str, t: NkiTensor, allowed=("sbuf", "psum")) -> NkiTensor:
    _tensor(call, name, t)
    if t.buffer not in allowed:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} must be in {' or '.join(a.upper() for a in allowed)}")
    p, limit = t.partitions(), current().target.partitions
    if p > limit:
        raise NkiError(f"nisa.{call}: {name} partition dimension {p} exceeds maximum {limit}")
    if t.ndim < 2:
        raise NkiError(f"nisa.{call}: {name} {t.describe()} needs a partition dim and a free dim")
    return t


def _same_layout(call: str, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
    if a.partitions() != b.partitions() or a.per_partition() != b.per_partition():
        raise NkiError(f"nisa.{call}: {an} {list(a.shape)} and {bn} {list(b.shape)} must have the same partition "
                       "count and the same number of elements per partition")


def _pf(t: NkiTensor) -> np.ndarray:
    """Values as (partitions, free) float32, the engines' arithmetic type."""
    v = t.read()
    return v.reshape(t.partitions(), -1).astype(np.float32 if is_float(t.dtype) or v.dtype.kind != "i" else np.int64)


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


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src between HBM and SBUF (either way), SBUF and SBUF, HBM and HBM; never PSUM."""
    _tensor("dma_copy", "dst", dst)
    _tensor("dma_copy", "src", src)
    for n, t in (("src", src), ("dst", dst)):
        if t.buffer == "psum":
            raise NkiError(f"nisa.dma_copy: {n} {t.describe()} is in PSUM; DMA cannot access PSUM "
                           "(copy it to SBUF with nisa.tensor_copy first)")
        if t.buffer == "sbuf" and t.partitions() > current().target.partitions:
            raise NkiError(f"nisa.dma_copy: {n} partition dimension {t.partitions()} exceeds maximum 128")
    if dst.size != src.size:
        raise NkiError(f"nisa.dma_copy: dst {list(dst.shape)} and src {list(src.shape)} hold different numbers of "
                       "elements")
    if dge_mode == _Dge.hwdge and dst.dtype != src.dtype:
        raise NkiError("nisa.dma_copy: dge_mode=hwdge needs equal dtypes (use .view())")
    keep = np.ones(dst.size, bool)
    for n, t in (("src", src), ("dst", dst)):
        if isinstance(t, _Indirect) and t.bad().any():
            if oob_mode == _Oob.error:
                bad = t.offsets[t.bad()].reshape(-1)[0]
                raise NkiError(f"nisa.dma_copy: {n} access pattern reaches element {bad} outside "
                               f"{t.name or 'the tensor'} of {t.storage.data.size} elements (oob_mode=error)")
            rows = t.bad().reshape(t.shape[0], -1).any(axis=1)  # skip: whole indirect rows are dropped
            keep &= np.repeat(~rows, t.size // t.shape[0])
    vals = src.storage.data[np.where(keep.reshape(src.shape), src.offsets, 0)].reshape(-1)
    if src.dtype != dst.storage.dtype:
        vals = vals.astype(np.float32)
    dst_off = dst.offsets.reshape(-1)[keep]
    dst.storage.data[dst_off] = cast(vals[keep], dst.storage.dtype)
    return NkiInstruction()


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
    out = op.unary(x).astype(np.float32)
    acc = current().act_acc
    if reduce_op is not None and getattr(reduce_op, "name", "") != "add":
        raise NkiError(f"nisa.activation: reduce_op must be nl.add, got {reduce_op!r}")
    if reduce_cmd in (_Cmd.reset, _Cmd.reset_reduce):
        acc[:p] = 0.0
    if reduce_cmd in (_Cmd.reduce, _Cmd.reset_reduce, _Cmd.load_reduce):
        if reduce_op is None:
            raise NkiError(f"nisa.activation: reduce_cmd={reduce_cmd.name} needs reduce_op=nl.add")
        acc[:p] += out.sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
        _on_chip("activation", "reduce_res", reduce_res)
        if reduce_res.partitions() != p or reduce_res.per_partition() != 1:
            raise NkiError(f"nisa.activation: reduce_res {list(reduce_res.shape)} must be ({p}, 1)")
        _put(reduce_res, acc[:p].reshape(p, 1))
    _put(dst, out)
    return NkiInstruction()


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                      reduce_cmd=_Cmd.reset_reduce)


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


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    for n, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _on_chip("tensor_tensor", n, t)
    if data1.shape != data2.shape and (data1.partitions() != data2.partitions()
                                       or data1.per_partition() != data2.per_partition()):
        raise NkiError(f"nisa.tensor_tensor: data1 {list(data1.shape)} and data2 {list(data2.shape)} differ; no "
                       "broadcasting (use tensor_scalar for a (P, 1) operand)")
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise NkiError("nisa.tensor_tensor: data1 and data2 cannot both be in PSUM")
    _same_layout("tensor_tensor", dst, "dst", data1, "data1")
    if op.bitvec:
        r = op.binary(data1.read().reshape(data1.partitions(), -1), data2.read().reshape(data2.partitions(), -1))
    else:
        r = _apply("tensor_tensor", op, _pf(data1), _pf(data2))
    _put(dst, r)
    return NkiInstruction()


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    _on_chip("tensor_scalar", "dst", dst)
    _on_chip("tensor_scalar", "data", data)
    _same_layout("tensor_scalar", dst, "dst", data, "data")
    p = data.partitions()
    r = _apply("tensor_scalar", op0, _pf(data), _operand("tensor_scalar", "operand0", operand0, p), reverse0)
    if op1 is not None:
        r = _apply("tensor_scalar", op1, r, _operand("tensor_scalar", "operand1", operand1, p), reverse1)
    _put(dst, r)
    return NkiInstruction()


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


def reciprocal(dst, data, name=None):
    _on_chip("reciprocal", "dst", dst)
    _on_chip("reciprocal", "data", data)
    _same_layout("reciprocal", dst, "dst", data, "data")
    with np.errstate(divide="ignore"):
        _put(dst, np.float32(1.0) / _pf(data))
    return NkiInstruction()


def memset(dst, value, engine=engine.unknown, name=None):
    _on_chip("memset", "dst", dst)
    if not is_float(dst.dtype) and not float(value).is_integer():
        raise NkiError(f"nisa.memset: value {value!r} does not match the integer dtype {dst.dtype} of dst")
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


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    _on_chip("iota", "dst", dst, allowed=("sbuf",))
    _put(dst, _affine("iota", dst, pattern, offset, channel_multiplier).astype(np.int32))
    return NkiInstruction()


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    _on_chip("affine_select", "dst", dst, allowed=("sbuf",))
    _on_chip("affine_select", "on_true_tile", on_true_tile, allowed=("sbuf",))
    _same_layout("affine_select", dst, "dst", on_true_tile, "on_true_tile")
    v = _affine("affine_select", dst, pattern, offset, channel_multiplier).astype(np.float32)
    cond = (cmp_op.binary(v, np.float32(0)) if cmp_op is not None else (v == 0)) != 0
    _put(dst, np.where(cond, _pf(on_true_tile), np.float32(on_false_value)))
    return NkiInstruction()


# -- TensorE -------------------------------------------------------------------------------------------------------


def _bank_check(call: str, dst: NkiTensor) -> None:
    bank = current().target.psum_bank_bytes
    item = dst.storage.data.itemsize
    free = (dst.offsets.reshape(dst.partitions(), -1) % dst.storage.free_size) * item
    if free.size and free.min() // bank != free.max() // bank:
        raise NkiError(f"nisa.{call}: dst {dst.describe()} spans more than one PSUM bank ({bank} bytes per "
                       "partition); keep each matmul output within one bank")


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
    if (stationary.dtype in fp32) != (moving.dtype in fp32):
        raise NkiError(f"nisa.nc_matmul: stationary {stationary.dtype} and moving {moving.dtype}: if one is "
                       "float32/tfloat32 both must be")
    if dst.partitions() != m or dst.per_partition() != n:
        raise NkiError(f"nisa.nc_matmul: dst {list(dst.shape)} must be [M={m}, N={n}]")
    _bank_check("nc_matmul", dst)
    res = _pf(stationary).T.astype(np.float32) @ _pf(moving).astype(np.float32)
    written = dst.storage.written[dst.offsets].reshape(m, n)
    if accumulate is True and not written.all():
        warnings.warn("nisa.nc_matmul: accumulate=True into PSUM that was never written (undefined on hardware)",
                      stacklevel=2)
    if accumulate is True:
        res = np.nan_to_num(_pf(dst), nan=0.0) * written + res if not written.all() else _pf(dst) + res
    elif accumulate is None:
        res = np.where(written, _pf(dst) + res, res)
    _put(dst, res)
    return NkiInstruction()


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


__all__ = [
    "activation", "activation_reduce", "affine_select", "dge_mode", "dma_copy", "engine", "get_nc_version", "iota",
    "matmul_perf_mode", "memset", "nc_matmul", "nc_transpose", "nc_version", "oob_mode", "reciprocal", "reduce_cmd",
    "scalar_tensor_tensor", "tensor_copy", "tensor_reduce", "tensor_scalar", "tensor_tensor",
]
