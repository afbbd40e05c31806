"""The interpreter's dtypes: NKI names to NumPy (bfloat16 and float8 from ml_dtypes, packed MX types as raw
bits), and the rounding of a value to a destination dtype."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import NkiError

_NP = {
    "float32": np.float32, "tfloat32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3": ml_dtypes.float8_e4m3, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2, "float64": np.float64,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "bool_": np.uint8,
    # packed MX types (nki.language dtypes; four values per element): stored as their raw bits
    "float8_e5m2_x4": np.uint32, "float8_e4m3fn_x4": np.uint32, "float4_e2m1fn_x4": np.uint16,
}
PACKED = ("float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4")


def np_dtype(dtype: str) -> np.dtype:
    try:
        return np.dtype(_NP[str(dtype)])
    except KeyError:
        raise NkiError(f"unsupported dtype {dtype!r}; supported: {', '.join(_NP)}") from None


def nki_dtype(arr_dtype: Any) -> str:
    d = np.dtype(arr_dtype)
    for name, t in _NP.items():
        if np.dtype(t) == d and name not in ("tfloat32", "bool_") + PACKED:
            return name
    if d == np.bool_:
        return "bool_"
    raise NkiError(f"arrays of dtype {d} cannot be passed to a kernel")


def is_float(dtype: str) -> bool:
    if dtype in PACKED:
        return False
    return np.issubdtype(np_dtype(dtype), np.floating) or dtype == "bfloat16" or dtype.startswith("float8")


def cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """Engine results (float32/float64) to a destination dtype: floats round, ints round half-even and saturate."""
    target = np_dtype(dtype)
    values = np.asarray(values)
    if values.dtype == target:
        return values
    if np.issubdtype(target, np.integer):
        if np.issubdtype(values.dtype, np.integer):
            info = np.iinfo(target)
            return np.clip(values, info.min, info.max).astype(target)
        info = np.iinfo(target)
        with np.errstate(invalid="ignore"):
            v = np.rint(np.asarray(values, dtype=np.float64))
        v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(v, info.min, info.max).astype(target)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(target)
