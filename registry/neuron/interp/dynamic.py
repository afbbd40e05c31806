"""An access pattern with a run-time start (``scalar_offset``, ``vector_offset``): one start per row and a strided
pattern within the row, bounds-checked when it is used (``oob_mode``) before any memory is touched."""

from __future__ import annotations

import numpy as np

from .dtypes import cast, np_dtype
from .errors import NkiError
from .tensor import NkiTensor, Storage, extent, strided_view


class Dynamic(NkiTensor):
    """An access pattern with run-time starts: ``starts`` (one per partition row for ``vector_offset``, one for
    ``scalar_offset``) plus a static strided pattern. Offsets outside the storage are checked when used, per
    ``oob_mode``, before any memory is touched."""

    def __init__(self, storage: Storage, dtype: str, starts: np.ndarray, counts, steps, per_row: bool, indices=()):
        self.storage, self.dtype = storage, dtype
        self.starts, self.per_row, self.indices = starts, per_row, tuple(indices)
        self.counts, self.steps = list(counts), list(steps)
        self.inner = (self.counts[1:], self.steps[1:]) if per_row else (self.counts, self.steps)
        self.vector = per_row

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.counts)

    @property
    def offset(self) -> int:
        return int(self.starts[0]) if self.starts.size else 0

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self.steps)

    def is_indirect(self) -> bool:
        return True

    def _flat(self) -> np.ndarray:
        return self.storage.flat(self.dtype)

    def read_dtype(self) -> np.dtype:
        return np_dtype(self.dtype)

    def bad_rows(self) -> np.ndarray:
        """Which rows (of ``starts``) reach outside the storage."""
        size = self._flat().size
        lo, hi = extent(0, *self.inner)
        return (self.starts + lo < 0) | (self.starts + hi >= size)

    def first_bad(self) -> int:
        bad = self.bad_rows()
        s = int(self.starts[bad][0])
        lo, hi = extent(s, *self.inner)
        return lo if lo < 0 else hi

    def rows(self, keep: np.ndarray | None = None) -> list[np.ndarray | None]:
        """A strided view per row (None for a row not kept)."""
        flat = self._flat()
        return [strided_view(flat, int(s), *self.inner) if keep is None or keep[i] else None
                for i, s in enumerate(self.starts)]

    def _check(self, use: str) -> None:
        if self.bad_rows().any():
            raise NkiError(f"{use}: the dynamic access pattern reaches element {self.first_bad()} outside "
                           f"{self.name or 'the tensor'} of {self._flat().size} elements")

    def read(self) -> np.ndarray:
        self._check("read")
        self.use()
        rows = self.rows()
        return np.stack(rows) if self.per_row else rows[0]

    def write(self, values: np.ndarray) -> None:
        self._check("write")
        self.use()
        values = np.broadcast_to(values, self.shape)
        for i, r in enumerate(self.rows()):
            r[...] = cast(values[i] if self.per_row else values, self.dtype)
        self.storage.dirty = True
        if self.storage.written is not None:
            for s in self.starts:
                strided_view(self.storage.written, int(s), *self.inner)[...] = True

    def mirror(self, flat: np.ndarray) -> np.ndarray:
        self._check("read")
        rows = [strided_view(flat, int(s), *self.inner) for s in self.starts]
        return np.stack(rows) if self.per_row else rows[0]

    def partition_rows(self) -> np.ndarray:
        free = max(1, self.storage.free_size)
        if self.per_row:
            return self.starts // free + self.storage.partition0
        rows = (self.starts[0] + self.steps[0] * np.arange(self.counts[0], dtype=np.int64)) // free
        return rows + self.storage.partition0

    def free_extent(self) -> tuple[int, int]:
        free = max(1, self.storage.free_size)
        return extent(int(self.starts[0]) % free, self.counts[1:], self.steps[1:])

    def overlaps(self, other: NkiTensor) -> bool:
        return other.storage is self.storage

    def __getitem__(self, key):
        raise NkiError("a dynamic access pattern (scalar_offset/vector_offset) cannot be indexed further; build the "
                       "pattern you need with .ap()")

    def reshape(self, shape):
        raise NkiError("a dynamic access pattern cannot be reshaped; build the pattern you need with .ap()")
