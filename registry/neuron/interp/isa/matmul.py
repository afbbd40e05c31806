"""``nki.isa`` on TensorE: matmul into a PSUM bank, and transpose."""

from __future__ import annotations

import warnings

import numpy as np

from ..constants import engine, matmul_perf_mode
from ..errors import NkiError
from ..state import current
from ..tensor import NkiTensor
from .checks import (
    Engine,
    NkiInstruction,
    floats_of,
    instruction,
    on_chip,
    put,
)

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
    on_chip("nc_matmul", "stationary", stationary, allowed=("sbuf",))
    on_chip("nc_matmul", "moving", moving, allowed=("sbuf",))
    on_chip("nc_matmul", "dst", dst, allowed=("psum",))
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
    res = floats_of(stationary).T.astype(np.float32) @ floats_of(moving).astype(np.float32)
    written = dst.mirror(dst.storage.written).reshape(m, n)
    if accumulate is True and not written.all():
        warnings.warn("nisa.nc_matmul: accumulate=True into PSUM that was never written (undefined on hardware)",
                      stacklevel=2)
    if accumulate is True:
        res = np.nan_to_num(floats_of(dst), nan=0.0) * written + res if not written.all() else floats_of(dst) + res
    elif accumulate is None:
        res = np.where(written, floats_of(dst) + res, res)
    put(dst, res)
    return NkiInstruction()


@instruction
def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F]: TensorE (SBUF -> PSUM, up to 128 x 128) or VectorE (up to 32 x 32)."""
    on_chip("nc_transpose", "data", data)
    on_chip("nc_transpose", "dst", dst)
    p, f = data.partitions(), data.per_partition()
    use_vector = engine == Engine.vector or (engine == Engine.unknown and dst.buffer != "psum")
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
    put(dst, data.read().reshape(p, f).T)
    return NkiInstruction()
