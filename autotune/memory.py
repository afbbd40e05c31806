"""Peak memory of a region: one method for a kernel's region and the compiler's, and for ``verify``'s full step.

A region's peak is the most memory it holds at once above what was live before it, counted in three parts:

- PyTorch's allocations on the region's device: the running sum of the profiler's allocation and free events,
  at its peak, where a free counts only for a block allocated in the region (matched by address: the profiler
  reports the free of an older block too where the allocator knew its size, and freeing older memory must not
  offset the region's own);
- numpy's buffers, which numpy reports to ``tracemalloc`` (an output a kernel makes with numpy, a kernel's
  scratch arrays), at their own peak; Python's own objects come with them, a few KiB;
- every block of the CPU kernels' reused memory (``registry.cpu.outputs``) that the region takes an output from,
  whole, as held through the region: the pool keeps it, in use or not. A block the pool makes during the region is a
  numpy buffer already counted as one.

The parts are added. Where numpy's peak and PyTorch's fall at different moments the sum is above the true peak,
never below it; the compiler's code allocates no numpy memory, so that can only count against a kernel. Not
counted: what numba's runtime allocates inside ``@njit`` code (the pack makes its outputs outside it).

The profiler and tracemalloc slow what they watch: the tuner and ``verify`` run a region once more, untimed, to
measure it (``peak_bytes``), never while timing.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

MIB = 2**20


def mib(nbytes: int) -> float:
    """Bytes as MiB, to four significant digits (as a table records them)."""
    return float(f"{nbytes / MIB:.4g}")


def _start(prof) -> None:
    """Start the profiler. Kineto prints two lines on every start and stop of the profiler unless its log level,
    read from the environment once when the profiler first starts, says otherwise: that level is set for the
    start only (a user's own setting stands)."""
    if "KINETO_LOG_LEVEL" in os.environ:
        prof.start()
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"  # above every level kineto prints
    try:
        prof.start()
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


@contextmanager
def _numpy_peak(out: dict[str, int]) -> Iterator[None]:
    """The peak of memory ``tracemalloc`` traces (numpy's buffers, and Python's objects) during the block, above
    what it traced when the block began, into ``out["numpy"]``."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    try:
        yield
    finally:
        out["numpy"] = max(0, tracemalloc.get_traced_memory()[1] - before)
        if started:
            tracemalloc.stop()


def _allocations(nodes, kind: str) -> Iterator[tuple[int, int, int]]:
    """(time, address, bytes) of every allocation (bytes > 0) and free (bytes < 0) on devices of ``kind`` in the
    profiler's event tree."""
    for node in nodes:
        f = node.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and f.device.type == kind:
            yield node.start_time_ns, f.ptr, f.alloc_size
        yield from _allocations(node.children, kind)


def peak_bytes(fn: Callable[[], object], device: str = "cpu") -> int:
    """The peak bytes one call of ``fn`` holds at once above what was live before it (the module's docstring
    says what counts)."""
    from torch.profiler import ProfilerActivity, profile

    from ..registry.cpu import outputs as _outputs

    kind = torch.device(device).type
    host = kind == "cpu"  # numpy's buffers and the pool's blocks are host memory
    held = _outputs.held()
    parts: dict[str, int] = {}
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    _start(prof)
    try:
        with torch.profiler.record_function("nki_autotune::peak_bytes"):
            pass  # its first use imports modules: before the count starts, not inside it
        with _numpy_peak(parts) if host else nullcontext():
            fn()
    finally:
        prof.stop()
    made = _outputs.held() - held  # blocks the pool made meanwhile: numpy buffers, counted by tracemalloc
    results = prof.profiler.kineto_results
    pooled = {}
    for e in results.events():
        if host and e.name().startswith(_outputs.MARK):
            address, nbytes = e.name()[len(_outputs.MARK):].split()
            pooled[address] = int(nbytes)
    live = peak = 0
    mine: set[int] = set()  # the addresses of blocks allocated in the region and not yet freed
    for _, ptr, n in sorted(_allocations(results.experimental_event_tree(), kind)):
        if n < 0:
            if ptr not in mine:
                continue
            mine.discard(ptr)
        else:
            mine.add(ptr)
        live += n
        peak = max(peak, live)
    return peak + parts.get("numpy", 0) + max(0, sum(pooled.values()) - made)


__all__ = ["MIB", "mib", "peak_bytes"]
