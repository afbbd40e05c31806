"""Run-time integers of the interpreter: ``nisa.NkiScalar`` (NKI 0.7) and ``nisa.VirtualRegister``.

Under the tracer frontend of NKI 0.7 a scalar's value is computed on device: arithmetic on it is traced, and
Python control flow on it (``if``, ``while``, ``int()``, ``range()``) is a ``TypeError`` (docs:
nki.isa.NkiScalar, nki.isa.VirtualRegister, nki/deep-dives/nki-scalar.rst). The interpreter knows the value, but
refuses every use the tracer refuses, so a kernel that runs here also specializes on the real stack.
"""

from __future__ import annotations

from .errors import NkiError

_WIDTH = {"int32": 32, "int64": 64}


class NkiTypeError(NkiError, TypeError):
    """A run-time value used where only a specialization-time value can go."""


def _wrap(value: int, dtype: str) -> int:
    """32-bit scalars wrap rather than widen (NkiScalar: 100000 * 100000 yields 1410065408)."""
    bits = _WIDTH[dtype]
    half = 1 << (bits - 1)
    return (value + half) % (1 << bits) - half


class _RunTime:
    """A value known only when the kernel runs."""

    _what = "a run-time value"

    def _refuse(self, use: str):
        raise NkiTypeError(f"{use} of {self._what}: its value exists only on device; use it as a scalar_offset or a "
                           "fori_loop bound (docs: nki.isa.NkiScalar, nki.isa.VirtualRegister)")

    def __bool__(self):
        self._refuse("Python control flow (if/while/and/or)")

    def __int__(self):
        self._refuse("int()")

    def __index__(self):
        self._refuse("range(), slicing or indexing")

    def __float__(self):
        self._refuse("float()")

    def __hash__(self) -> int:
        return id(self)


class NkiScalar(_RunTime):
    """One integer computed on device, from ``nisa.scalar_load`` or a ``fori_loop`` index."""

    _what = "an NkiScalar"

    def __init__(self, value: int, dtype: str = "int32", comparison: bool = False):
        if dtype not in _WIDTH:
            raise NkiError(f"NkiScalar dtype {dtype}: scalars are nl.int32 or nl.int64")
        self._value, self.dtype, self._comparison = _wrap(int(value), dtype), dtype, comparison

    def __repr__(self) -> str:
        return f"NkiScalar({self.dtype})"

    def value(self, use: str) -> int:
        """The value, for the interpreter's own use (``use`` names the API that reads it)."""
        if self._comparison:
            raise NkiError(f"{use}: the result of a comparison of NkiScalars is traced but cannot be used "
                           "(nki.isa.NkiScalar)")
        return self._value

    def _other(self, other, op: str) -> int:
        if isinstance(other, NkiScalar):
            if other.dtype != self.dtype:
                raise NkiError(f"NkiScalar {op}: dtypes {self.dtype} and {other.dtype} differ; they must match")
            return other.value(f"NkiScalar {op}")
        if isinstance(other, int) and not isinstance(other, bool):
            return other
        raise NkiError(f"NkiScalar {op}: the other operand must be a Python int or an NkiScalar, got "
                       f"{type(other).__name__}")

    def _arith(self, other, op: str, fn, reverse: bool = False) -> NkiScalar:
        a, b = self.value(f"NkiScalar {op}"), self._other(other, op)
        return NkiScalar(fn(b, a) if reverse else fn(a, b), self.dtype)

    def __add__(self, o):
        return self._arith(o, "+", lambda a, b: a + b)

    def __radd__(self, o):
        return self._arith(o, "+", lambda a, b: a + b, True)

    def __sub__(self, o):
        return self._arith(o, "-", lambda a, b: a - b)

    def __rsub__(self, o):
        return self._arith(o, "-", lambda a, b: a - b, True)

    def __mul__(self, o):
        return self._arith(o, "*", lambda a, b: a * b)

    def __rmul__(self, o):
        return self._arith(o, "*", lambda a, b: a * b, True)

    def __neg__(self):
        return NkiScalar(-self.value("NkiScalar unary -"), self.dtype)

    def _compare(self, other, op: str) -> NkiScalar:
        if self.dtype == "int64":
            raise NkiError(f"NkiScalar {op}: comparisons of nl.int64 scalars are rejected at compile time")
        self._other(other, op)
        return NkiScalar(0, self.dtype, comparison=True)

    def __lt__(self, o):
        return self._compare(o, "<")

    def __le__(self, o):
        return self._compare(o, "<=")

    def __gt__(self, o):
        return self._compare(o, ">")

    def __ge__(self, o):
        return self._compare(o, ">=")

    def __eq__(self, o):  # type: ignore[override]
        return self._compare(o, "==")

    def __ne__(self, o):  # type: ignore[override]
        return self._compare(o, "!=")

    def _unsupported(self, *_):
        raise NkiError("NkiScalar supports +, - and * (nki.isa.NkiScalar); compute other arithmetic on tiles")

    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __truediv__ = __rtruediv__ = _unsupported


class VirtualRegister(_RunTime):
    """A sequencer register (``nisa.register_alloc``), uninitialized unless given a value."""

    _what = "a VirtualRegister"

    def __init__(self, value: int | None = None):
        self._value = None if value is None else _wrap(int(value), "int32")

    def __repr__(self) -> str:
        return "VirtualRegister()"

    def value(self, use: str) -> int:
        if self._value is None:
            raise NkiError(f"{use}: the VirtualRegister was read before any value was moved or loaded into it")
        return self._value

    def set(self, value: int) -> None:
        self._value = _wrap(int(value), "int32")


def runtime_value(x, use: str) -> int:
    """An int, NkiScalar or VirtualRegister as an int (``use`` names the API)."""
    if isinstance(x, (NkiScalar, VirtualRegister)):
        return x.value(use)
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    raise NkiError(f"{use}: expected an int, an NkiScalar or a VirtualRegister, got {type(x).__name__}")
