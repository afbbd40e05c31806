"""What every numba kernel of the pack shares: compilation, launch, zero-copy views, bfloat16 elements.

numba has no bfloat16: a bfloat16 tensor reaches a kernel as its int16 bits (``array``). Kernels read every
element through ``f32`` and write through ``cast_to``; both are specialised by type at compile time, so a
float32 kernel compiles to what it would without them, and a bfloat16 one widens exactly (a 16-bit shift)
and narrows by round-to-nearest-even, as ``Tensor.to(torch.bfloat16)`` does (nan stays nan).

Kernels compile with the fast-math flags that let sums vectorise (reassociation, signless zeros) and no
others: not ``nnan``/``ninf`` (inf and nan follow IEEE arithmetic as in PyTorch), not ``arcp`` (LLVM then
computes 1/sqrt(inf) as nan through a reciprocal estimate), not ``contract`` (a fused ``acc + a * b`` keeps
a product that PyTorch's separate multiply rounds to inf). Division by zero gives inf or nan as in numpy
(``error_model="numpy"``), never an exception.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import types
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types as nbtypes
from numba.extending import intrinsic, overload

from ..sources import source_hash
from . import outputs as _outputs

FASTMATH = {"nsz", "reassoc"}
ELEMENTWISE = {"nsz"}
"""Without reassociation: each element's operations in the expression's own order, where it decides what
overflows (``silu(g) * u`` is not ``g * u / (1 + exp(-g))`` at u = 3e38). Kernels whose loops are element-wise
use it (a sum over a loop vectorises only with reassociation: such a sum goes in a function of its own)."""
FLOATS = ("float32", "bfloat16")
"""The float dtypes every CPU kernel takes (computing in float32)."""
_OPTS = dict(fastmath=FASTMATH, error_model="numpy")


_HELPERS = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]


def _build_tag(fn: Callable) -> str:
    """The source hash of the module that defines ``fn`` (``registry.sources``: its module and the helpers it
    imports, this runtime's included), else this module's: numba's on-disk cache checks only the kernel's own
    file, so a kernel cached before a change of its helpers would otherwise keep running the old ones."""
    return source_hash(fn.__module__) or _HELPERS


def kernel(fn: Callable, fastmath: set[str] = FASTMATH, bind: dict[str, Callable] | None = None
           ) -> tuple[Callable, Callable]:
    """A serial and a parallel build of one kernel body (``prange`` is ``range`` in the serial one).

    One thread skips the parallel launch, which costs more than small inputs take. ``bind`` replaces global names
    of the body by other numba functions: one loop shared by kernels that differ in an element-wise function
    (SwiGLU's and GeGLU's activations).
    """
    opts = dict(cache=True, nogil=True, **{**_OPTS, "fastmath": fastmath})
    env, tag = fn.__globals__, _build_tag(fn)
    if bind:
        env = {**fn.__globals__, **bind}
        files = sorted({inspect.getfile(getattr(f, "py_func", f)) for f in bind.values()})
        # numba's cache checks only the body's file: the bound functions' files and names name the build too (two
        # activations of one file are two builds)
        names = "_".join(f"{k}_{getattr(f, 'py_func', f).__name__}" for k, f in sorted(bind.items()))
        tag += "_" + hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()[:10] + "_" + names

    def build(suffix: str, **extra) -> Callable:
        # numba's on-disk cache is keyed by qualified name: each build, and each version of the helpers, its own
        f = types.FunctionType(fn.__code__, env, fn.__name__ + suffix, fn.__defaults__)
        f.__qualname__ = f"{fn.__qualname__}{suffix}_{tag}"
        return numba.njit(**opts, **extra)(f)

    return build("_serial"), build("", parallel=True)


def inline(fn: Callable) -> Callable:
    """A small helper copied into the kernels that call it as numba IR, with the kernels' arithmetic rules: for
    what runs per element (``exp32``), where ``helper`` left SwiGLU's loops 5% slower."""
    return numba.njit(inline="always", **_OPTS)(fn)


def helper(fastmath: set[str]) -> Callable[[Callable], Callable]:
    """A helper that holds loops, compiled apart with ``fastmath`` (the rules of the kernels that call it) and
    inlined into them by LLVM. ``inline`` would copy it into every caller before numba's parallel passes: the
    example's five kernels (serial and parallel builds) then compile in 23 s instead of 11, no faster."""
    return lambda fn: numba.njit(**{**_OPTS, "fastmath": fastmath})(fn)


@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return nbtypes.float32(nbtypes.int32), codegen


@intrinsic
def _bits_from_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return nbtypes.int32(nbtypes.float32), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c rounded once (``llvm.fma``), whatever the fast-math flags: for kernels to fuse where a product
    cannot overflow on its own (a factor within [-1, 1], or a square added to a sum of squares)."""
    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return nbtypes.float32(nbtypes.float32, nbtypes.float32, nbtypes.float32), codegen


@intrinsic
def fmax32(typingctx, a, b):
    """The larger of two float32, nan if either is (``llvm.maximum``, as ``torch.maximum``): unlike Python's
    ``max``, a running maximum of it vectorises without assuming away nan."""
    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maximum", [f], ir.FunctionType(f, [f, f]))
        return builder.call(fn, args)

    return nbtypes.float32(nbtypes.float32, nbtypes.float32), codegen


def f32(v):
    """One element as float32: a float32 as it is, a bfloat16 (int16 bits) widened exactly."""
    raise NotImplementedError("f32 runs only inside numba kernels")


def cast_to(a, v):
    """float32 ``v`` as an element of array ``a``: as it is for float32, rounded to bfloat16 bits for int16."""
    raise NotImplementedError("cast_to runs only inside numba kernels")


@overload(f32, inline="always", jit_options=_OPTS)
def _f32(v):
    if v == nbtypes.float32:
        return lambda v: v
    if v == nbtypes.int16:
        return lambda v: _f32_from_bits(np.int32(v) << np.int32(16))
    return None


@overload(cast_to, inline="always", jit_options=_OPTS)
def _cast_to(a, v):
    if a.dtype == nbtypes.float32:
        return lambda a, v: np.float32(v)
    if a.dtype == nbtypes.int16:
        return lambda a, v: bf16_bits(np.float32(v))
    return None


@inline
def finite32(v):
    """Whether float32 ``v`` is finite, from its exponent bits: numba's ``np.isfinite`` tests ``v - v == 0``,
    which reassociation folds to true for inf and nan."""
    return (_bits_from_f32(np.float32(v)) & np.int32(0x7F800000)) != np.int32(0x7F800000)


def holds_f32(a):
    """Whether array ``a`` holds float32 elements (a compile-time constant: the branch not taken is dropped)."""
    raise NotImplementedError("holds_f32 runs only inside numba kernels")


@overload(holds_f32, inline="always", jit_options=_OPTS)
def _holds_f32(a):
    is_f32 = a.dtype == nbtypes.float32
    return lambda a: is_f32


@inline
def bf16_bits(v):
    """The bfloat16 nearest to float32 ``v`` (ties to even; nan to a quiet nan), as int16 bits."""
    b = np.int64(_bits_from_f32(v)) & 0xFFFFFFFF
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = np.int64((b & 0x7FFFFFFF) > 0x7F800000)
    return np.int16(r + nan * (0x7FC0 - r))  # no branch: numba's inliner leaves none in the caller's loop


_LO, _HI = np.float32(-86.643), np.float32(88.72283)


@inline
def exp32(x):
    """float32 exp that LLVM can vectorise (Cephes expf: Cody-Waite reduction, degree-6 polynomial, 2^k added
    to the result's exponent bits); relative error about 1.2e-7 from 2.2e-38 up to the largest float; below
    that 0 (PyTorch gives subnormals there: less than 2.2e-38 apart). numba's own np.exp is a scalar libm
    call per element here."""
    xc = min(max(x, _LO), _HI)
    k = np.floor(fma32(xc, np.float32(1.44269504), np.float32(0.5)))
    r = fma32(k, np.float32(2.12194440e-4), fma32(k, np.float32(-0.693359375), xc))
    p = fma32(np.float32(1.9875691500e-4), r, np.float32(1.3981999507e-3))  # fused: bounded terms, no overflow
    p = fma32(p, r, np.float32(8.3334519073e-3))
    p = fma32(p, r, np.float32(4.1665795894e-2))
    p = fma32(p, r, np.float32(1.6666665459e-1))
    p = fma32(p, r, np.float32(5.0000001201e-1))
    p = fma32(p, r * r, r + np.float32(1.0))
    # p * 2^k as an integer add to p's exponent: p is within [0.70, 1.42] (below 1 where k = 128, as x <= _HI),
    # so the result is a normal float for every k in [-125, 128] that the clamp leaves
    e = _f32_from_bits(_bits_from_f32(p) + (np.int32(k) << np.int32(23)))
    e = np.float32(0.0) if x < _LO else e
    e = np.float32(np.inf) if x > _HI else e
    return x if x != x else e


@inline
def tanh32(x):
    """float32 tanh that LLVM can vectorise (Cephes tanhf: an odd polynomial below |x| = 0.625, above it
    ``1 - 2 / (exp(2|x|) + 1)`` through ``exp32``); within about 2 ulps, ±1 where the rounded result is, ±1 at
    ±inf, nan at nan."""
    s = x * x
    p = fma32(np.float32(-5.70498872745e-3), s, np.float32(2.06390887954e-2))  # fused: |x| < 0.625 here
    p = fma32(p, s, np.float32(-5.37397155531e-2))
    p = fma32(p, s, np.float32(1.33314422036e-1))
    p = fma32(p, s, np.float32(-3.33332819422e-1))
    small = fma32(p * s, x, x)
    ax = abs(x)
    big = np.float32(1.0) - np.float32(2.0) / (exp32(ax + ax) + np.float32(1.0))
    big = big if x >= np.float32(0.0) else -big
    return small if ax < np.float32(0.625) else big


def launch(kern: tuple[Callable, Callable], threads: int, *args) -> None:
    """The serial build, or the parallel one on ``threads`` threads. numba's OpenMP layer sets its count in the
    OpenMP runtime PyTorch reads too: the caller's ``torch.set_num_threads`` is put back after the launch (else
    it would change under the model, and compiled code, which guards on it, would recompile)."""
    if threads <= 1:
        kern[0](*args)
        return
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        kern[1](*args)
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


_BF16, _I16, _F32 = torch.bfloat16, torch.int16, torch.float32


def array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy); a bfloat16 tensor's as int16 bits."""
    if t.requires_grad:  # (detaching costs a new tensor: only where numpy() needs it)
        t = t.detach()
    return (t.view(_I16) if t.dtype is _BF16 else t).numpy()


def as_rows(t: torch.Tensor) -> np.ndarray:
    """``array(t)`` as [rows, last dim] (a 0-d tensor as [1, 1]): a view where the leading dims collapse
    (``rows_view``), as supports() requires."""
    a = array(t)
    if a.ndim == 2:
        return a
    return a.reshape(math.prod(t.shape[:-1]), t.shape[-1] if t.dim() else 1)


def rows_of(t: torch.Tensor) -> tuple[int, int, int, np.ndarray | None]:
    """``t``'s rows (its last dim contiguous) as kernels read them through ``at`` and ``row``: the address of its
    first element, the elements its rows span, and where the leading dims collapse into one row axis
    (``rows_view``) the stride between rows and None; else, with no copy, 0 and each row's start, rows in ``t``'s
    row-major order (Hugging Face's per-head q/k, ``view(b, s, h, d).transpose(1, 2)``). Addresses, not numpy
    views: a view costs about a microsecond a tensor, which at a norm's small calls is more than its kernel."""
    if t.is_contiguous():
        return t.data_ptr(), t.numel(), t.shape[-1] if t.dim() else 1, None
    shape, strides = tuple(t.shape), t.stride()
    d = shape[-1]
    if t.numel() == 0:
        return t.data_ptr(), 0, d, None
    if d > 1 and strides[-1] != 1:
        raise ValueError(f"rows of stride {strides[-1]} (the kernels read a row's elements side by side)")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    if rows_view(shape, strides):
        dims = _leading(shape, strides)
        return t.data_ptr(), span, dims[-1][1] if dims else d, None
    starts = np.zeros(1, np.int64)
    for n, s in zip(shape[:-1], strides[:-1]):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return t.data_ptr(), span, 0, starts


@intrinsic
def _pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return nbtypes.voidptr(nbtypes.intp), codegen


@numba.njit(inline="always")
def at(address, shape, dtype):
    """The array of ``shape`` and ``dtype`` at ``address`` (a tensor's ``data_ptr()``, alive for the call)."""
    return numba.carray(_pointer(address), shape, dtype)


def row(a, starts, stride, r, d):
    """Row ``r`` (of ``d`` elements) of rows from ``rows_of`` over ``a`` (``at`` its address and span): the ``d``
    elements from ``r * stride``, or from ``starts[r]``."""
    raise NotImplementedError("row runs only inside numba kernels")


@overload(row, inline="always", jit_options=_OPTS)
def _row(a, starts, stride, r, d):
    if isinstance(starts, nbtypes.NoneType):
        return lambda a, starts, stride, r, d: a[r * stride:r * stride + d]
    return lambda a, starts, stride, r, d: a[starts[r]:starts[r] + d]


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new contiguous output (a large one on reused memory: ``_outputs``)."""
    return _outputs.new(shape, dtype)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``t``'s shape and dtype, whatever ``t``'s layout (as ``empty``)."""
    if t.numel() * t.element_size() < _outputs.FROM:
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return _outputs.new(t.shape, t.dtype)


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 result ``t`` in ``dtype`` (rounded to nearest even for bfloat16; ``t`` itself for float32)."""
    return t if dtype is _F32 else t.to(dtype)


def _leading(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """The leading dims (all but the last) of more than one element, as (size, stride): a dim of one element has
    no stride that matters."""
    return [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]


def rows_view(spec_shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """Whether a tensor's leading dims collapse into one row axis (so ``reshape(-1, D)`` is a view)."""
    if strides is None or len(spec_shape) <= 2:
        return True
    dims = _leading(spec_shape, strides)
    return all(s_outer == s_inner * n_inner for (_, s_outer), (n_inner, s_inner) in zip(dims, dims[1:]))


def require(specs, dtypes: dict[int, tuple[str, ...]], contiguous: bool = True) -> str | None:
    """The common part of supports(): each listed input's dtype, one float dtype for all float inputs (the
    expression would promote mixed ones), and contiguity of all inputs (an absent optional one, None, passes)."""
    for i, allowed in dtypes.items():
        if specs[i] is not None and specs[i].dtype not in allowed:
            return f"input {i} of dtype {specs[i].dtype} (supports {', '.join(allowed)})"
    specs = [s for s in specs if s is not None]
    floats = sorted({s.dtype for s in specs if s.is_float})
    if len(floats) > 1:
        return f"mixed float dtypes {', '.join(floats)} (supports one float dtype for all inputs)"
    if contiguous and not all(s.is_contiguous for s in specs):
        return "non-contiguous inputs"
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
