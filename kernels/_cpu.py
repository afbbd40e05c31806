"""What every numba kernel of the pack shares: compilation, launch, zero-copy views."""

from __future__ import annotations

import types
from collections.abc import Callable

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types as nbtypes
from numba.extending import intrinsic


def kernel(fn: Callable) -> tuple[Callable, Callable]:
    """A serial and a parallel build of one kernel body (``prange`` is ``range`` in the serial one).

    One thread skips the parallel launch, which costs more than small inputs take.
    """
    opts = dict(fastmath=True, cache=True, nogil=True)
    # numba's on-disk cache is keyed by qualified name: give the serial build its own.
    serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__)
    serial.__qualname__ = fn.__qualname__ + "_serial"
    return numba.njit(**opts)(serial), numba.njit(parallel=True, **opts)(fn)


@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return nbtypes.float32(nbtypes.int32), codegen


_LO, _HI = np.float32(-87.33654), np.float32(88.72283)


@numba.njit(inline="always", fastmath=True)
def exp32(x):
    """float32 exp that LLVM can vectorise (Cephes expf: Cody-Waite reduction, degree-6 polynomial, 2^k built
    from its bits); relative error about 1.2e-7. numba's own np.exp is a scalar libm call per element here."""
    xc = min(max(x, _LO), _HI)
    k = np.floor(xc * np.float32(1.44269504) + np.float32(0.5))
    r = xc - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = p * _f32_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))
    e = np.float32(0.0) if x < _LO else e
    e = np.float32(np.inf) if x > _HI else e
    return x if x != x else e


@numba.njit(inline="always", fastmath=True)
def max_sumexp(x, r, online, skip=-1):
    """Row r's max m and the sum of exp(x - m) over every column but ``skip``: in one pass rescaling the
    sum (online) or in two. Leaving a column out of the sum, rather than subtracting it afterwards, keeps
    the rest of a peaked row exact (cross-entropy's loss and gradient at a confident target)."""
    zero = np.float32(0.0)
    m = np.float32(-np.inf)
    s = zero
    if online:
        for j in range(x.shape[1]):
            v = x[r, j]
            if v > m:
                s = s * exp32(m - v) + (zero if j == skip else np.float32(1.0))
                m = v
            else:
                s += zero if j == skip else exp32(v - m)
    else:
        for j in range(x.shape[1]):
            m = max(m, x[r, j])
        if skip < 0:
            s = sumexp(x[r], m)
        else:  # two slices: a per-column skip test, or a loop from a run-time start, defeats the vectoriser
            s = sumexp(x[r, :skip], m) + sumexp(x[r, skip + 1:], m)
    return m, s


@numba.njit(inline="always", fastmath=True)
def sumexp(row, m):
    s = np.float32(0.0)
    for j in range(row.shape[0]):
        s += exp32(row[j] - m)
    return s


@numba.njit(inline="always")
def softplus64(z):
    """log(1 + exp(z)) in float64 without overflow, exact to a few ulps for tiny results."""
    return z + np.log1p(np.exp(-z)) if z > 0.0 else np.log1p(np.exp(z))


def launch(kern: tuple[Callable, Callable], threads: int, *args) -> None:
    if threads <= 1:
        kern[0](*args)
        return
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    kern[1](*args)


def array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy)."""
    return t.detach().numpy()


def max_threads() -> int:
    return int(numba.config.NUMBA_NUM_THREADS)


def thread_choices() -> tuple[int, ...]:
    """1, 2, 4, ... up to this machine's core count."""
    out, n = [], 1
    while n < max_threads():
        out.append(n)
        n *= 2
    out.append(max_threads())
    return tuple(sorted(set(out)))


def rows_view(spec_shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """Whether a tensor's leading dims collapse into one row axis (so ``reshape(-1, D)`` is a view)."""
    if strides is None or len(spec_shape) <= 2:
        return True
    dims = [(n, s) for n, s in zip(spec_shape[:-1], strides[:-1]) if n != 1]
    return all(s_outer == s_inner * n_inner for (_, s_outer), (n_inner, s_inner) in zip(dims, dims[1:]))


def require(specs, dtypes: dict[int, tuple[str, ...]], contiguous: bool = True) -> str | None:
    """The common part of supports(): each listed input's dtype, and contiguity of all inputs."""
    for i, allowed in dtypes.items():
        if specs[i].dtype not in allowed:
            return f"input {i} of dtype {specs[i].dtype} (supports {', '.join(allowed)})"
    if contiguous and not all(s.is_contiguous for s in specs):
        return "non-contiguous inputs"
    if any(s.numel == 0 for s in specs):
        return "empty inputs"
    return None


def out_of_range(index: np.ndarray, size: int) -> int | None:
    """The first index outside [0, size), if any (the kernels trust their indices)."""
    if index.size == 0:
        return None
    lo, hi = int(index.min()), int(index.max())
    if lo < 0:
        return lo
    if hi >= size:
        return hi
    return None
