"""Tensors of the NKI interpreter: storage, views, indexing and access patterns.

Every tensor is a storage (one flat NumPy array per allocation, in its NKI dtype)
plus an integer array of element offsets into it, shaped like the tensor. Views,
slices, permutations, broadcasts and ``.ap()`` access patterns are all just new
offset arrays over the same storage, so reads gather and writes scatter, and
indirect (``vector_offset`` / ``scalar_offset``) patterns need nothing special.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from .errors import NkiError
from .scalar import NkiScalar, VirtualRegister
from .state import current

HBM_BUFFERS = ("hbm", "private_hbm", "shared_hbm")
ON_CHIP = ("sbuf", "psum")

_NP = {
    "float32": np.float32, "tfloat32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3": ml_dtypes.float8_e4m3, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2, "float64": np.float64,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "bool_": np.uint8,
}


def np_dtype(dtype: str) -> np.dtype:
    try:
        return np.dtype(_NP[dtype])
    except KeyError:
        raise NkiError(f"unsupported dtype {dtype!r}; supported: {', '.join(_NP)}") from None


def nki_dtype(arr_dtype: Any) -> str:
    d = np.dtype(arr_dtype)
    for name, t in _NP.items():
        if np.dtype(t) == d and name not in ("tfloat32", "bool_"):
            return name
    if d == np.bool_:
        return "bool_"
    raise NkiError(f"arrays of dtype {d} cannot be passed to a kernel")


def is_float(dtype: str) -> bool:
    return np.issubdtype(np_dtype(dtype), np.floating) or dtype == "bfloat16" or dtype.startswith("float8")


def cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """Engine results (float32/float64) to a destination dtype: floats round, ints round half-even and saturate."""
    target = np_dtype(dtype)
    if np.issubdtype(target, np.integer):
        info = np.iinfo(target)
        with np.errstate(invalid="ignore"):
            v = np.rint(np.asarray(values, dtype=np.float64))
        v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(v, info.min, info.max).astype(target)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values).astype(target)


class Storage:
    """One allocation: a flat array, the shape it was made with, its buffer."""

    def __init__(self, shape: tuple[int, ...], dtype: str, buffer: str, name: str = "", data: np.ndarray | None = None):
        self.shape, self.dtype, self.buffer, self.name = tuple(shape), dtype, buffer, name
        if data is None:
            data = np.empty(math.prod(shape), np_dtype(dtype))
            data[...] = np.nan if is_float(dtype) else 4  # the real simulator's sentinels
        self.data = data.reshape(-1)
        self.written = np.zeros(self.data.size, bool) if buffer == "psum" else None
        self.interval = None  # the live range of an on-chip allocation (memory.Memory)

    @property
    def free_size(self) -> int:
        """Elements per partition of an on-chip allocation."""
        return math.prod(self.shape[1:])


def _normalize_key(key: Any, ndim: int) -> list:
    key = list(key) if isinstance(key, tuple) else [key]
    if any(k is Ellipsis for k in key):
        i = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = key[:i] + [slice(None)] * (ndim - len(key) + 1) + key[i + 1:]
    if len(key) > ndim:
        raise NkiError(f"too many indices ({len(key)}) for a tensor of rank {ndim}")
    return key + [slice(None)] * (ndim - len(key))


class NkiTensor:
    """A tensor of the interpreter: a view (offset array) over a storage."""

    def __init__(self, storage: Storage, offsets: np.ndarray, dtype: str | None = None):
        self.storage = storage
        self.offsets = offsets
        self.dtype = dtype or storage.dtype

    # -- attributes ---------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.offsets.shape)

    @property
    def ndim(self) -> int:
        return self.offsets.ndim

    @property
    def size(self) -> int:
        return int(self.offsets.size)

    @property
    def buffer(self) -> str:
        return self.storage.buffer

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def on_chip(self) -> bool:
        return self.storage.buffer in ON_CHIP

    @property
    def offset(self) -> int:
        return int(self.offsets.reshape(-1)[0]) if self.offsets.size else 0

    def __repr__(self) -> str:
        return f"NkiTensor({self.name or 'unnamed'}, shape={self.shape}, dtype={self.dtype}, buffer={self.buffer})"

    def describe(self) -> str:
        return f"{self.name or 'tensor'}{list(self.shape)} in {self.buffer}"

    # -- values -------------------------------------------------------------------------------------------
    def read(self) -> np.ndarray:
        return self.storage.data[self.offsets]

    def write(self, values: np.ndarray) -> None:
        values = np.broadcast_to(values, self.shape)
        self.storage.data[self.offsets] = cast(values, self.storage.dtype)
        if self.storage.written is not None:
            self.storage.written[self.offsets] = True

    def partitions(self) -> int:
        return self.shape[0] if self.ndim else 1

    def per_partition(self) -> int:
        return math.prod(self.shape[1:]) if self.ndim > 1 else 1

    # -- views --------------------------------------------------------------------------------------------
    def _view(self, offsets: np.ndarray) -> NkiTensor:
        return NkiTensor(self.storage, offsets, self.dtype)

    def __getitem__(self, key: Any) -> NkiTensor:
        key = _normalize_key(key, self.ndim)
        for k in key:
            if not isinstance(k, (int, np.integer, slice)):
                raise NkiError(f"index {k!r}: NKI tensors take ints, slices, nl.ds(...) and '...' "
                               "(no integer arrays; use .ap(vector_offset=...) for gathers)")
        if self.on_chip:
            if isinstance(key[0], (int, np.integer)):
                i = int(key[0])
                key[0] = slice(i, i + 1 if i != -1 else None)
            ints = [j for j in range(1, len(key)) if isinstance(key[j], (int, np.integer))]
            if ints and len(key) - len(ints) < 2:
                j = ints[-1]  # keep the last int-indexed free dim, at size 1
                i = int(key[j])
                key[j] = slice(i, i + 1 if i != -1 else None)
        for d, k in enumerate(key):
            if isinstance(k, (int, np.integer)) and not -self.shape[d] <= k < self.shape[d]:
                raise NkiError(f"index {k} out of range for dim {d} of size {self.shape[d]} of {self.describe()}")
            if isinstance(k, slice) and k.stop is not None and k.stop > self.shape[d]:
                raise NkiError(f"slice {k.start}:{k.stop} runs past dim {d} of size {self.shape[d]} of "
                               f"{self.describe()}")
        return self._view(self.offsets[tuple(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        target = self[key]
        target.write(value.read() if isinstance(value, NkiTensor) else np.asarray(value))

    def reshape(self, shape) -> NkiTensor:
        shape = tuple(shape)
        if math.prod(shape) != self.size:
            raise NkiError(f"reshape of {self.describe()} to {list(shape)}: element counts differ")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiError(f"reshape of on-chip {self.describe()} must keep the partition dim {self.shape[0]}")
        return self._view(self.offsets.reshape(shape))

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        if self.on_chip and dims[0] != 0:
            raise NkiError(f"permute of on-chip {self.describe()} must keep dim 0 (the partition dim) first")
        return self._view(self.offsets.transpose(dims))

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise NkiError(f"broadcast of dim {dim} of {self.describe()}: the dim must have size 1")
        if self.on_chip and dim == 0:
            raise NkiError("broadcast along the partition dim is done with a matmul, not a view")
        shape = list(self.shape)
        shape[dim] = size
        return self._view(np.broadcast_to(self.offsets, shape))

    def expand_dim(self, dim: int) -> NkiTensor:
        return self._view(np.expand_dims(self.offsets, dim))

    def squeeze_dim(self, dim: int) -> NkiTensor:
        return self._view(np.squeeze(self.offsets, dim))

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def ap(self, pattern, offset: int | None = None, scalar_offset=None, vector_offset: NkiTensor | None = None,
           indirect_dim: int = 0, dtype: str | None = None) -> NkiTensor:
        """An explicit access pattern over the flattened base storage (the current view is ignored; ``offset=None``
        inherits the view's start). Docs: nki/deep-dives/nki-aps.rst; dynamic starts add
        ``index * prod(base.shape[indirect_dim + 1:])``."""
        pattern = [tuple(p) for p in pattern]
        where = f".ap on {self.describe()}"
        if not pattern or any(len(p) != 2 for p in pattern):
            raise NkiError(f"{where}: pattern={pattern}: a pattern is a list of [step, count] pairs")
        if offset is not None and not (isinstance(offset, (int, np.integer)) and not isinstance(offset, bool)):
            raise NkiError(f"{where}: offset must be a compile-time int (elements from the start of the tensor); "
                           f"got {type(offset).__name__}: pass a run-time start as scalar_offset")
        if scalar_offset is not None and vector_offset is not None:
            raise NkiError(f"{where}: scalar_offset and vector_offset are mutually exclusive")
        if not 0 <= indirect_dim < len(self.storage.shape):
            raise NkiError(f"{where}: indirect_dim={indirect_dim} is not a dim of the {len(self.storage.shape)}-d "
                           "base tensor")
        base = self.offset if offset is None else int(offset)
        free = self.storage.free_size
        if self.on_chip and pattern[0][1] > 1 and pattern[0][0] != free:
            raise NkiError(f"{where}: the partition pair's step must be the storage's free size {free}, got "
                           f"{pattern[0][0]} (nki-aps.rst: the first pair of an on-chip pattern is the partition)")
        counts = [int(c) for _, c in pattern]
        offs = np.full(counts, base, dtype=np.int64)
        for axis, (step, count) in enumerate(pattern):
            if axis == 0 and vector_offset is not None:
                continue  # each partition's row comes from its index, at the base tensor's row stride
            shape = [1] * len(counts)
            shape[axis] = count
            offs = offs + int(step) * np.arange(count, dtype=np.int64).reshape(shape)
        row = math.prod(self.storage.shape[indirect_dim + 1:])
        indices: list = []
        if scalar_offset is not None:
            offs = offs + self._scalar_index(scalar_offset, where) * row
            if isinstance(scalar_offset, NkiTensor):
                indices.append(scalar_offset.storage)
        if vector_offset is not None:
            if self.on_chip:
                raise NkiError(f"{where}: vector_offset indexes an HBM tensor (nki.isa.dma_copy: 'the tensor being "
                               "indexed must be in HBM')")
            if indirect_dim != 0:
                raise NkiError(f"{where}: vector_offset works on indirect_dim=0 only")
            if not isinstance(vector_offset, NkiTensor) or vector_offset.buffer != "sbuf":
                raise NkiError(f"{where}: vector_offset must be an SBUF tile (P, 1) of row indices")
            idx = np.asarray(vector_offset.read()).astype(np.int64).reshape(-1)
            if idx.size != counts[0]:
                raise NkiError(f"{where}: vector_offset has {idx.size} indices for {counts[0]} partitions")
            offs = offs + idx.reshape([-1] + [1] * (len(counts) - 1)) * row
            indices.append(vector_offset.storage)
        dynamic = scalar_offset is not None or vector_offset is not None
        view = _Indirect(self.storage, offs, dtype or self.dtype, dynamic, vector_offset is not None, indices)
        if not dynamic:
            bad = view.bad()
            if bad.any():
                raise NkiError(f"{where}: pattern {pattern} from offset {base} reaches element "
                               f"{int(offs[bad].reshape(-1)[0])}, outside the {self.storage.data.size} elements of "
                               "the tensor")
            if self.on_chip and len(counts) > 1:
                rows = offs.reshape(counts[0], -1) // free
                if (rows != rows[:, :1]).any():
                    raise NkiError(f"{where}: pattern {pattern} from offset {base} runs past the end of a partition "
                                   f"({free} elements each); an on-chip access stays within its partitions")
        return view

    def _scalar_index(self, x, where: str) -> int:
        """The value of a scalar_offset: a 1x1 SBUF tile, an NkiScalar or a VirtualRegister."""
        if isinstance(x, NkiTensor):
            if x.size != 1 or x.buffer != "sbuf":
                raise NkiError(f"{where}: a tensor scalar_offset is a (1, 1) SBUF tile, got {x.describe()}")
            return int(np.asarray(x.read()).reshape(-1)[0])
        if isinstance(x, NkiScalar):
            if self.on_chip and x.dtype != "int32":
                raise NkiError(f"{where}: an SBUF/PSUM operand takes an nl.int32 scalar_offset, got {x.dtype} "
                               "(nki.isa.scalar_load)")
            return x.value(where)
        if isinstance(x, VirtualRegister):
            return x.value(where)
        raise NkiError(f"{where}: scalar_offset must be a (1, 1) SBUF tile, an NkiScalar or a VirtualRegister, got "
                       f"{type(x).__name__}")

    def view(self, dtype: str) -> NkiTensor:
        if np_dtype(dtype).itemsize != np_dtype(self.dtype).itemsize:
            raise NkiError("view(dtype) with a different element size is not supported by the interpreter")
        st = Storage(self.storage.shape, dtype, self.buffer, self.name, self.storage.data.view(np_dtype(dtype)))
        st.interval, st.written = getattr(self.storage, "interval", None), self.storage.written
        return NkiTensor(st, self.offsets, dtype)

    def is_indirect(self) -> bool:
        return False


class _Indirect(NkiTensor):
    """An access pattern: dynamic offsets may fall outside the storage (checked when used, per oob_mode)."""

    def __init__(self, storage, offsets, dtype, dynamic: bool, vector: bool = False, indices=()):
        super().__init__(storage, offsets, dtype)
        self.dynamic, self.vector, self.indices = dynamic, vector, tuple(indices)

    def is_indirect(self) -> bool:
        return self.dynamic

    def bad(self) -> np.ndarray:
        return (self.offsets < 0) | (self.offsets >= self.storage.data.size)


def new_tensor(shape, dtype: str, buffer: str, name: str = "") -> NkiTensor:
    """Allocate (NaN-filled, like the simulator); on-chip tensors open a live range in the launch's memory."""
    shape = tuple(int(s) for s in shape)
    if buffer in ON_CHIP and not shape:
        raise NkiError(f"nl.ndarray(shape=[], buffer=nl.{buffer}): on-chip tensors have a partition dim")
    if buffer in ON_CHIP and dtype == "float64":
        raise NkiError(f"nl.ndarray(dtype=float64, buffer=nl.{buffer}): the engines have no float64; on-chip "
                       "floats are float32, tfloat32, bfloat16, float16 or float8")
    st = Storage(shape, dtype, buffer, name)
    if buffer in ON_CHIP:
        current().memory.allocate(st, shape, np_dtype(dtype).itemsize, buffer, name)
    return NkiTensor(st, np.arange(st.data.size, dtype=np.int64).reshape(shape))
