"""Memory for the CPU kernels' large outputs, reused once the last tensor over it is gone.

glibc maps every block of 32 MiB or more on its own and unmaps it when freed, so each new output that large
faults in its 4 KiB pages one by one on the first write, and the kernel zeroes each: filling a new one takes several
times what refilling one does, more than a cross-entropy's whole backward into it (docs/benchmarks.md, "Figures
behind the code"). A training step makes the same large outputs every step (the
cross-entropy's gradient, a large embedding's weight gradient), so the kernels keep those blocks and hand one out
again once no tensor uses it: a caching allocator for these sizes only, as PyTorch's CUDA allocator is for all.
Below 32 MiB glibc maps a block on its own or reuses freed memory depending on the largest block freed so far in
the process, so an output just under it (the example's 31.25 MiB embedding gradient) is fast or slow by the
history of the process; the pool does not take those, as a kept block sits idle through the rest of the step (the
embedding's through the step's peak: more peak memory in the example, ``benchmarks/test_memory.py``).
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
"""Outputs of this many bytes and more come from the pool (glibc reuses smaller ones by itself)."""
PER_SIZE = 2
LIMIT = 2 << 30

_lock = threading.Lock()
_blocks: dict[int, list[np.ndarray]] = {}
_held = 0
MARK = "nki_autotune::pooled_output "
"""Name of the profiler event that marks an output handed out by the pool, followed by the block's address and
bytes: the profiler sees PyTorch's allocations, not these, so a measurement of memory adds them."""
_FREE = 3
"""A block's reference count when no tensor uses it: the pool's list, the loop's name, getrefcount's argument.
A tensor made by ``torch.from_numpy`` keeps its array, and a view keeps the array it views."""


def _block(nbytes: int) -> np.ndarray | None:
    global _held
    with _lock:
        blocks = _blocks.setdefault(nbytes, [])
        for b in blocks:
            if sys.getrefcount(b) == _FREE:
                return b
        if len(blocks) >= PER_SIZE or _held + nbytes > LIMIT:
            return None
        b = np.empty(nbytes, np.uint8)
        blocks.append(b)
        _held += nbytes
        return b


def new(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` whose contents are undefined, as ``torch.empty``."""
    nbytes = dtype.itemsize * math.prod(shape)
    b = _block(nbytes) if nbytes >= FROM else None
    if b is None:
        return torch.empty(shape, dtype=dtype)
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(f"{MARK}{b.ctypes.data} {nbytes}"):
            pass
    out = torch.from_numpy(b).view(dtype).view(shape)
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        # as torch.empty then fills (the numerics check relies on it: an output a kernel leaves unwritten shows)
        out.fill_(math.nan if dtype.is_floating_point else torch.iinfo(dtype).max)
    return out


def held() -> int:
    """Bytes the pool holds, in use or not."""
    return _held
