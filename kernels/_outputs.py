"""Memory for the CPU kernels' large outputs, reused once the last tensor over it is gone.

glibc maps every block of 32 MiB or more on its own and unmaps it when freed, so each new output that large
faults in its 4 KiB pages one by one on the first write, and the kernel zeroes each: filling a new 2048 x 32000
float32 tensor takes 47 ms where refilling one takes 8 (``benchmarks/test_first_touch.py``), more than a
cross-entropy's whole backward into it. A training step makes the same large outputs every step (the
cross-entropy's gradient, an embedding's weight gradient), so the kernels keep those blocks and hand one out
again once no tensor uses it: a caching allocator for these sizes only, as PyTorch's CUDA allocator is for all.
Each size keeps at most ``PER_SIZE`` blocks and all together at most ``LIMIT`` bytes; beyond that an output is
an ordinary allocation. The compiler's code gets no such reuse: a kernel's gain here is real but belongs to
the allocation, not the arithmetic (the benchmarks show both sides' bandwidth).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import torch

FROM = 32 << 20
"""Outputs of this many bytes and more come from the pool (smaller ones glibc reuses by itself)."""
PER_SIZE = 2
LIMIT = 2 << 30

_lock = threading.Lock()
_blocks: dict[int, list[np.ndarray]] = {}
_held = _served = 0
_FREE = 3
"""A block's reference count when no tensor uses it: the pool's list, the loop's name, getrefcount's argument.
A tensor made by ``torch.from_numpy`` keeps its array, and a view keeps the array it views."""


def _block(nbytes: int) -> np.ndarray | None:
    global _held, _served
    with _lock:
        blocks = _blocks.setdefault(nbytes, [])
        for b in blocks:
            if sys.getrefcount(b) == _FREE:
                _served += nbytes
                return b
        if len(blocks) >= PER_SIZE or _held + nbytes > LIMIT:
            return None
        b = np.empty(nbytes, np.uint8)
        blocks.append(b)
        _held += nbytes
        _served += nbytes
        return b


def new(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` whose contents are undefined, as ``torch.empty``."""
    nbytes = dtype.itemsize * math.prod(shape)
    b = _block(nbytes) if nbytes >= FROM else None
    if b is None:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(b).view(dtype).view(shape)


def held() -> int:
    """Bytes the pool holds, in use or not."""
    return _held


def served() -> int:
    """Bytes of outputs the pool has handed out so far: memory PyTorch's allocator (and its profiler) does not
    see, for measurements of peak memory to add."""
    return _served
