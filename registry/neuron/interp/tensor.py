"""Tensors of the NKI interpreter: storage, views, indexing and access patterns.

Every tensor is a storage (one flat NumPy array per allocation, in its NKI dtype) and a NumPy strided view of it:
slices, permutations, reshapes, broadcasts and static ``.ap()`` access patterns are views over the same memory,
so a view costs nothing per element and reads and writes go straight to the storage. An access pattern with a
run-time start (``scalar_offset``, ``vector_offset``) is a ``Dynamic`` tensor: one start per row and a strided
pattern within the row, bounds-checked when it is used (``oob_mode``) before any memory is touched.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .dtypes import PACKED, cast, is_float, nki_dtype, np_dtype  # noqa: F401  (the tensors' own dtypes)
from .errors import NkiError
from .scalar import NkiScalar, VirtualRegister
from .state import current

HBM_BUFFERS = ("hbm", "private_hbm", "shared_hbm")
ON_CHIP = ("sbuf", "psum")

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
        self.dirty = False
        """Written by the kernel (an input is copied back to the caller's array only then)."""
        self.partition0 = 0
        """The first partition of an on-chip allocation (placed with ``address=``; else 0)."""
        self.is_input = False
        """A kernel argument: returnable whatever its buffer (a kernel may write an input in place and return it)."""

    @property
    def free_size(self) -> int:
        """Elements per partition of an on-chip allocation."""
        return math.prod(self.shape[1:])

    def flat(self, dtype: str) -> np.ndarray:
        """The storage's memory as a flat array of ``dtype`` (a reinterpretation where the element size differs)."""
        want = np_dtype(dtype)
        if want == self.data.dtype:
            return self.data
        if want.itemsize == self.data.dtype.itemsize:
            return self.data.view(want)
        nbytes = self.data.nbytes - self.data.nbytes % want.itemsize
        return self.data.view(np.uint8)[:nbytes].view(want)


def _normalize_key(key: Any, ndim: int) -> list:
    key = list(key) if isinstance(key, tuple) else [key]
    if any(k is Ellipsis for k in key):
        i = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = key[:i] + [slice(None)] * (ndim - len(key) + 1) + key[i + 1:]
    if len(key) > ndim:
        raise NkiError(f"too many indices ({len(key)}) for a tensor of rank {ndim}")
    return key + [slice(None)] * (ndim - len(key))


def strided_view(flat: np.ndarray, start: int, shape, strides) -> np.ndarray:
    """A writeable strided view of ``flat`` from element ``start`` (strides in elements; callers check bounds)."""
    item = flat.itemsize
    return as_strided(flat[start:] if start < flat.size else flat[:0], shape=tuple(shape),
                      strides=tuple(int(s) * item for s in strides), writeable=True)


def extent(start: int, shape, strides) -> tuple[int, int]:
    """The lowest and highest element offset a strided pattern touches (an empty one: start, start - 1)."""
    if any(n == 0 for n in shape):
        return start, start - 1
    lo = start + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = start + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
    return lo, hi


class NkiTensor:
    """A tensor of the interpreter: a strided view over a storage."""

    def __init__(self, storage: Storage, arr: np.ndarray, dtype: str | None = None):
        self.storage = storage
        self.arr = arr
        self.dtype = dtype or storage.dtype

    # -- attributes ---------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.arr.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

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
    def itemsize(self) -> int:
        return np_dtype(self.dtype).itemsize

    @property
    def offset(self) -> int:
        """The view's first element, in elements of its dtype from the start of the storage."""
        flat = self.storage.flat(self.dtype)
        delta = self.arr.__array_interface__["data"][0] - flat.__array_interface__["data"][0]
        return delta // self.arr.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """The view's strides in elements of its dtype."""
        return tuple(s // self.arr.itemsize for s in self.arr.strides)

    def __repr__(self) -> str:
        return f"NkiTensor({self.name or 'unnamed'}, shape={self.shape}, dtype={self.dtype}, buffer={self.buffer})"

    def describe(self) -> str:
        return f"{self.name or 'tensor'}{list(self.shape)} in {self.buffer}"

    # -- values -------------------------------------------------------------------------------------------
    def read(self) -> np.ndarray:
        """The values (a view: callers that keep or change them copy)."""
        self.use()
        return self.arr

    def use(self) -> None:
        """Every read and write is a use of an on-chip tile for its live range (memory.Memory), a (P, 1) operand
        tile and a write outside an instruction (nl.zeros, ``t[...] = v``) included."""
        if self.storage.interval is not None:
            current().memory.touch(self.storage)

    def write(self, values: np.ndarray) -> None:
        self.use()
        self.arr[...] = cast(np.broadcast_to(values, self.shape), self.dtype)
        self.storage.dirty = True
        if self.storage.written is not None:
            self.mirror(self.storage.written)[...] = True

    def mirror(self, flat: np.ndarray) -> np.ndarray:
        """The same view over another flat array of the storage's length (e.g. PSUM's written flags)."""
        return strided_view(flat, self.offset, self.shape, self.strides)

    def partitions(self) -> int:
        return self.shape[0] if self.ndim else 1

    def per_partition(self) -> int:
        return math.prod(self.shape[1:]) if self.ndim > 1 else 1

    def partition_rows(self) -> np.ndarray:
        """The storage partition of each of the view's partitions (on chip: offset // free size)."""
        p = self.partitions()
        step = self.strides[0] if self.ndim else 0
        rows = (self.offset + step * np.arange(p, dtype=np.int64)) // max(1, self.storage.free_size)
        return rows + self.storage.partition0

    def free_extent(self) -> tuple[int, int]:
        """The lowest and highest element within a partition that the view touches."""
        free = max(1, self.storage.free_size)
        lo, hi = extent(self.offset % free, self.shape[1:], self.strides[1:])
        return lo, hi

    def overlaps(self, other: NkiTensor) -> bool:
        return other.storage is self.storage and np.shares_memory(self.arr, other.arr, max_work=10 ** 6)

    # -- views --------------------------------------------------------------------------------------------
    def _with(self, arr: np.ndarray) -> NkiTensor:
        return NkiTensor(self.storage, arr, self.dtype)

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
        return self._with(self.arr[tuple(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        target = self[key]
        target.write(value.read() if isinstance(value, NkiTensor) else np.asarray(value))

    def reshape(self, shape) -> NkiTensor:
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != self.size:
            raise NkiError(f"reshape of {self.describe()} to {list(shape)}: element counts differ")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiError(f"reshape of on-chip {self.describe()} must keep the partition dim {self.shape[0]}")
        try:
            arr = self.arr.reshape(shape, copy=False)
        except ValueError:
            raise NkiError(f"reshape of {self.describe()} to {list(shape)}: the view's strides "
                           f"{list(self.strides)} cannot be merged without a copy") from None
        return self._with(arr)

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        if self.on_chip and dims[0] != 0:
            raise NkiError(f"permute of on-chip {self.describe()} must keep dim 0 (the partition dim) first")
        return self._with(self.arr.transpose(dims))

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise NkiError(f"broadcast of dim {dim} of {self.describe()}: the dim must have size 1")
        if self.on_chip and dim == 0:
            raise NkiError("broadcast along the partition dim is done with a matmul, not a view")
        shape, strides = list(self.shape), list(self.arr.strides)
        shape[dim], strides[dim] = size, 0
        return self._with(as_strided(self.arr, shape=shape, strides=strides, writeable=True))

    def broadcast_to(self, shape) -> NkiTensor:
        out = self
        for d, (have, want) in enumerate(zip(self.shape, shape)):
            if have != want:
                out = out.broadcast(d, want)
        return out

    def expand_dim(self, dim: int) -> NkiTensor:
        return self._with(np.expand_dims(self.arr, dim))

    def squeeze_dim(self, dim: int) -> NkiTensor:
        return self._with(np.squeeze(self.arr, dim))

    def reshape_dim(self, dim: int, shape) -> NkiTensor:
        """Split dim ``dim`` into ``shape`` (a view)."""
        new = self.shape[:dim] + tuple(shape) + self.shape[dim + 1:]
        return self.reshape(new)

    def flatten_dims(self, start: int, end: int) -> NkiTensor:
        """Merge dims ``start`` to ``end`` (inclusive) into one (a view)."""
        new = self.shape[:start] + (math.prod(self.shape[start:end + 1]),) + self.shape[end + 1:]
        return self.reshape(new)

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index) -> NkiTensor:
        if isinstance(index, (int, np.integer)):
            key: list = [slice(None)] * self.ndim
            key[dim] = int(index)
            return self[tuple(key)]
        raise NkiError(f"select(dim={dim}, {type(index).__name__}): the interpreter takes an int index; use "
                       ".ap(scalar_offset=...) for a run-time one")

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        return bool(self.arr.flags.c_contiguous)

    def ap(self, pattern, offset: int | None = None, scalar_offset=None, vector_offset: NkiTensor | None = None,
           indirect_dim: int = 0, dtype: str | None = None) -> NkiTensor:
        """An explicit access pattern over the flattened base storage (the current view is ignored; ``offset=None``
        inherits the view's start). Docs: nki/deep-dives/nki-aps.rst; dynamic starts add
        ``index * prod(base.shape[indirect_dim + 1:])``."""
        pattern = [tuple(p) for p in pattern]
        where = f".ap on {self.describe()}"
        dtype = str(dtype) if dtype is not None else self.dtype
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
        flat = self.storage.flat(dtype)
        ratio = np_dtype(self.dtype).itemsize / flat.itemsize
        base = int(self.offset * ratio) if offset is None else int(offset)
        free = self.storage.free_size * self.storage.data.itemsize // flat.itemsize
        if self.on_chip and pattern[0][1] > 1 and pattern[0][0] != free:
            raise NkiError(f"{where}: the partition pair's step must be the storage's free size {free}, got "
                           f"{pattern[0][0]} (nki-aps.rst: the first pair of an on-chip pattern is the partition)")
        counts = [int(c) for _, c in pattern]
        steps = [int(s) for s, _ in pattern]
        row = math.prod(self.storage.shape[indirect_dim + 1:]) * self.storage.data.itemsize // flat.itemsize
        if scalar_offset is None and vector_offset is None:
            lo, hi = extent(base, counts, steps)
            if lo < 0 or hi >= flat.size:
                raise NkiError(f"{where}: pattern {pattern} from offset {base} reaches element "
                               f"{lo if lo < 0 else hi}, outside the {flat.size} elements of the tensor")
            if self.on_chip and len(counts) > 1 and counts[0] > 0:
                first = base % free
                lo, hi = extent(first, counts[1:], steps[1:])
                if lo < 0 or hi >= free:
                    raise NkiError(f"{where}: pattern {pattern} from offset {base} runs past the end of a partition "
                                   f"({free} elements each); an on-chip access stays within its partitions")
            return NkiTensor(self.storage, strided_view(flat, base, counts, steps), dtype)
        indices: list = []
        if scalar_offset is not None:
            starts = np.array([base + self._scalar_index(scalar_offset, where) * row], np.int64)
            if isinstance(scalar_offset, NkiTensor):
                indices.append(scalar_offset.storage)
            from .dynamic import Dynamic  # a view of this class

            return Dynamic(self.storage, dtype, starts, counts, steps, per_row=False, indices=indices)
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
        indices.append(vector_offset.storage)
        # each partition's row comes from its index, at the base tensor's row stride
        from .dynamic import Dynamic

        return Dynamic(self.storage, dtype, base + idx * row, counts, steps, per_row=True, indices=indices)

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

    def view(self, dtype) -> NkiTensor:
        """The same bytes as ``dtype``; a different element size rescales the last dim, which must be contiguous."""
        dtype = str(dtype)
        new = np_dtype(dtype)
        if new.itemsize != self.arr.itemsize and self.ndim and self.strides[-1] != 1:
            raise NkiError(f"view({dtype}) of {self.describe()}: the last dim must be contiguous to change the "
                           "element size")
        return NkiTensor(self.storage, self.arr.view(new), dtype)

    def is_indirect(self) -> bool:
        return False


def new_tensor(shape, dtype: str, buffer: str, name: str = "", address=None) -> NkiTensor:
    """Allocate (NaN-filled, like the simulator); on-chip tensors open a live range in the launch's memory."""
    shape = tuple(int(s) for s in shape)
    dtype = str(dtype)
    if buffer in ON_CHIP and not shape:
        raise NkiError(f"nl.ndarray(shape=[], buffer=nl.{buffer}): on-chip tensors have a partition dim")
    if buffer in ON_CHIP and dtype == "float64":
        raise NkiError(f"nl.ndarray(dtype=float64, buffer=nl.{buffer}): the engines have no float64; on-chip "
                       "floats are float32, tfloat32, bfloat16, float16 or float8")
    st = Storage(shape, dtype, buffer, name)
    if buffer in ON_CHIP:
        current().memory.allocate(st, shape, np_dtype(dtype).itemsize, buffer, name, address)
    return NkiTensor(st, st.data.reshape(shape), dtype)


def wrap(arr: np.ndarray, buffer: str, name: str) -> NkiTensor:
    """A kernel argument: its own copy of ``arr`` in HBM."""
    st = Storage(arr.shape, nki_dtype(arr.dtype), buffer, name, np.array(arr, copy=True))
    st.is_input = True
    return NkiTensor(st, st.data.reshape(arr.shape))
