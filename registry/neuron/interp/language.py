"""``nki.language`` of the interpreter: buffers, dtypes, tile sizes, allocation, op tokens, helpers, loops.

NKI 0.7 semantics, unchanged in 0.8 (docs: nki/migration "Migrating from NKI 0.6.0 to NKI 0.7.0",
nki/deep-dives/nki-loops.rst):
Python loops are unrolled at specialization; ``affine_range``, ``sequential_range`` and ``static_range`` are
deprecated aliases of ``range``; ``nl.dynamic_range`` is removed; ``fori_loop`` and ``while_loop`` are compiled
loops whose index and condition are run-time values.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import numpy as np

from . import isa
from .errors import NkiError
from .scalar import NkiScalar, VirtualRegister, runtime_value
from .state import current
from .tensor import NkiTensor, new_tensor

# -- buffers and dtypes ------------------------------------------------------------------------------------------
sbuf, psum, hbm, private_hbm, shared_hbm = "sbuf", "psum", "private_hbm", "private_hbm", "shared_hbm"

bool_, int8, int16, int32, int64 = "bool_", "int8", "int16", "int32", "int64"
uint8, uint16, uint32 = "uint8", "uint16", "uint32"
float16, bfloat16, float32, tfloat32 = "float16", "bfloat16", "float32", "tfloat32"
float8_e4m3, float8_e4m3fn, float8_e5m2 = "float8_e4m3", "float8_e4m3fn", "float8_e5m2"
float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4 = "float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"
"""Packed MX dtypes (four values per element); the interpreter stores and moves their bits, and computes on none."""


class _NKIObjectType(type):
    """Builds NKIObjects as the NKI Library does: keywords the class's ``__init__`` does not take (a ``@dataclass``
    whose attributes carry no annotation, like attention_cte's ``SectionParams``) set those attributes after it."""

    def __call__(cls, *args, **kwargs):
        params = _init_params(cls)
        extra = {k: v for k, v in kwargs.items() if params is not None and k not in params}
        for k in extra:
            if not hasattr(cls, k):
                raise TypeError(f"{cls.__name__} has no attribute {k!r} to set")
        obj = super().__call__(*args, **{k: v for k, v in kwargs.items() if k not in extra})
        for k, v in extra.items():
            object.__setattr__(obj, k, v)
        return obj


@functools.cache
def _init_params(cls) -> frozenset | None:
    """The keyword parameters of ``cls.__init__``; None where it takes any."""
    sig = inspect.signature(cls.__init__)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(sig.parameters)


class NKIObject(metaclass=_NKIObjectType):
    """Base of the dataclass-like objects a kernel may take and build (NKI language guide: ``nl.NKIObject``
    subclasses are kernel arguments). A subclass without ``@dataclass`` is still built like one, by position or
    keyword from its annotated fields with their class defaults, then ``__post_init__`` (the NKI Library constructs
    ``RmsNormQuantKernelArgs(nl.NKIObject)`` so); with ``@dataclass`` its own ``__init__`` applies."""

    def __init__(self, *args, **kwargs):
        names = [n for klass in reversed(type(self).__mro__) for n in getattr(klass, "__annotations__", {})]
        names = list(dict.fromkeys(names))
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields, got {len(args)} positional values")
        values = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{type(self).__name__} has no field {k!r}; fields: {', '.join(names)}")
            values[k] = v
        for n in names:
            if n not in values and not hasattr(type(self), n):
                raise TypeError(f"{type(self).__name__}: missing field {n!r}")
            object.__setattr__(self, n, values[n] if n in values else getattr(type(self), n))
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()


def is_hbm(b: str) -> bool:
    return b in ("hbm", "private_hbm", "shared_hbm")


def is_sbuf(b: str) -> bool:
    return b == "sbuf"


def is_psum(b: str) -> bool:
    return b == "psum"


def is_on_chip(b: str) -> bool:
    return b in ("sbuf", "psum")


class _TileSize:
    pmax = 128
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_fmax = 512
    psum_num_banks = 8
    bn_stats_fmax = 512
    sbuf_min_align = psum_min_align = 16

    @property
    def sbuf_fmax_bytes(self) -> int:
        """Usable SBUF bytes per partition of the target (limits.Target.sbuf_partition_bytes)."""
        return current().target.sbuf_partition_bytes

    @property
    def sbuf_fmax(self) -> int:
        return self.sbuf_fmax_bytes // 4

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_size_bytes(self) -> int:
        return self.sbuf_fmax_bytes * self.pmax


tile_size = _TileSize()


# -- op tokens (also usable as tile helpers) ---------------------------------------------------------------------


class Fn:
    """An ALU op or activation function: a token for nisa calls, and an ``nl.*`` tile helper."""

    def __init__(self, name: str, binary=None, unary=None, reduce: bool = False, bitvec: bool = False,
                 domain: tuple[float, float, bool] | None = None):
        self.name, self.binary, self.unary, self.reduce, self.bitvec = name, binary, unary, reduce, bitvec
        self.domain = domain
        """(low, high, symmetric): the documented input range of an activation function, None for all reals."""

    @property
    def binary_exact(self):
        """The integer form of a binary op (GpSimd's native int32 arithmetic)."""
        return getattr(self.binary, "raw", self.binary)

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, x, y=None, dtype=None):
        """The ``nl.*`` helper: a new SBUF tile, computed by the ISA call the device would use."""
        xt = x if isinstance(x, NkiTensor) else None
        if xt is None:
            raise NkiError(f"nl.{self.name}: the first operand must be a tile")
        out = new_tensor(xt.shape, dtype or xt.dtype, "sbuf")
        if y is None:
            if self.unary is None:
                raise NkiError(f"nl.{self.name} takes two operands")
            isa.activation(dst=out, op=self, data=xt)
        elif isinstance(y, NkiTensor) and y.per_partition() > 1:
            isa.tensor_tensor(dst=out, data1=xt, data2=y, op=self)
        else:
            isa.tensor_scalar(dst=out, data=xt, op0=self, operand0=y)
        return out


def _b(f):
    def g(a, b):
        return f(a, b).astype(np.float32)

    g.raw = f
    return g


def _u(f):
    return lambda a: f(a).astype(np.float32)


def _erf(a):
    from math import erf

    return np.vectorize(erf, otypes=[np.float64])(a)


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a.astype(np.float64)))


add = Fn("add", _b(np.add), reduce=True)
subtract = Fn("subtract", _b(np.subtract), reduce=True)
multiply = Fn("multiply", _b(np.multiply), reduce=True)
divide = Fn("divide", _b(np.divide))
maximum = Fn("maximum", _b(np.maximum), reduce=True)
minimum = Fn("minimum", _b(np.minimum), reduce=True)
power = Fn("power", _b(np.power))
equal = Fn("equal", _b(np.equal))
not_equal = Fn("not_equal", _b(np.not_equal))
greater = Fn("greater", _b(np.greater))
greater_equal = Fn("greater_equal", _b(np.greater_equal))
less = Fn("less", _b(np.less))
less_equal = Fn("less_equal", _b(np.less_equal))
logical_and = Fn("logical_and", _b(lambda a, b: np.logical_and(a != 0, b != 0)), reduce=True)
logical_or = Fn("logical_or", _b(lambda a, b: np.logical_or(a != 0, b != 0)), reduce=True)
logical_xor = Fn("logical_xor", _b(lambda a, b: np.logical_xor(a != 0, b != 0)), reduce=True)
abs_max = Fn("abs_max", _b(lambda a, b: np.maximum(np.abs(a), np.abs(b))), reduce=True)
abs_min = Fn("abs_min", _b(lambda a, b: np.minimum(np.abs(a), np.abs(b))), reduce=True)
mod = Fn("mod", _b(np.mod))
fmod = Fn("fmod", _b(np.fmod))
bitwise_and = Fn("bitwise_and", np.bitwise_and, reduce=True, bitvec=True)
bitwise_or = Fn("bitwise_or", np.bitwise_or, reduce=True, bitvec=True)
bitwise_xor = Fn("bitwise_xor", np.bitwise_xor, reduce=True, bitvec=True)
left_shift = Fn("left_shift", np.left_shift, bitvec=True)
right_shift = Fn("right_shift", np.right_shift, bitvec=True)
invert = Fn("invert", unary=np.invert, bitvec=True)

with np.errstate(all="ignore"):
    copy = Fn("copy", unary=_u(lambda a: a))
    identity = copy
    square = Fn("square", unary=_u(np.square))
    exp = Fn("exp", unary=_u(np.exp))
    # documented input ranges (nki.api.shared, "Supported Activation Functions"); outside them results are invalid
    log = Fn("log", unary=_u(np.log), domain=(2.0 ** -64, 2.0 ** 64, False))
    sqrt = Fn("sqrt", unary=_u(np.sqrt), domain=(2.0 ** -116, 2.0 ** 118, False))
    rsqrt = Fn("rsqrt", unary=_u(lambda a: 1.0 / np.sqrt(a)), domain=(2.0 ** -87, 2.0 ** 97, False))
    reciprocal = Fn("reciprocal", unary=_u(lambda a: 1.0 / a), domain=(2.0 ** -42, 2.0 ** 42, True))
    abs = Fn("abs", unary=_u(np.abs))  # noqa: A001  (the NKI name)
    negative = Fn("negative", unary=_u(np.negative))
    sign = Fn("sign", unary=_u(np.sign))
    relu = Fn("relu", unary=_u(lambda a: np.maximum(a, 0)))
    sigmoid = Fn("sigmoid", unary=_u(_sigmoid))
    silu = Fn("silu", unary=_u(lambda a: a * _sigmoid(a)))
    silu_dx = Fn("silu_dx", unary=_u(lambda a: _sigmoid(a) * (1 + a * (1 - _sigmoid(a)))))
    tanh = Fn("tanh", unary=_u(np.tanh))
    softplus = Fn("softplus", unary=_u(lambda a: np.logaddexp(0, a)))
    mish = Fn("mish", unary=_u(lambda a: a * np.tanh(np.logaddexp(0, a))))
    erf = Fn("erf", unary=_u(_erf))
    gelu = Fn("gelu", unary=_u(lambda a: 0.5 * a * (1 + _erf(a / np.sqrt(2)))))
    gelu_apprx_sigmoid = Fn("gelu_apprx_sigmoid", unary=_u(lambda a: a * _sigmoid(1.702 * a)))
    gelu_apprx_tanh = Fn("gelu_apprx_tanh",
                         unary=_u(lambda a: 0.5 * a * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a ** 3)))))
    sin = Fn("sin", unary=_u(np.sin), domain=(-np.pi, np.pi, False))
    cos = Fn("cos", unary=_u(np.cos))
    arctan = Fn("arctan", unary=_u(np.arctan), domain=(-np.pi / 2, np.pi / 2, False))


# -- allocation and launch info ----------------------------------------------------------------------------------


def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> NkiTensor:
    """Uninitialised (NaN-filled, like the simulator). Returned tensors must use buffer=nl.shared_hbm. On-chip
    tensors may be placed with ``address=(partition, byte offset)``; they count in the capacity by the bytes they
    cover."""
    if address is not None and buffer not in ("sbuf", "psum"):
        raise NkiError(f"nl.ndarray(address={address!r}, buffer=nl.{buffer}): only SBUF and PSUM tensors are placed")
    if buffer == "shared_hbm":
        return current().shared_alloc(lambda: new_tensor(shape, dtype, buffer, name), shape, dtype)
    return new_tensor(shape, dtype, buffer, name, address)


def full(shape, fill_value, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    t.write(np.full(t.shape, fill_value))
    return t


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def zeros_like(t: NkiTensor, dtype=None, buffer=None) -> NkiTensor:
    return zeros(t.shape, dtype or t.dtype, buffer or t.buffer)


def empty_like(t: NkiTensor, dtype=None, buffer=None) -> NkiTensor:
    return ndarray(t.shape, dtype or t.dtype, buffer or t.buffer)


def ds(start: int, size: int) -> slice:
    return slice(start, start + size)


def program_id(axis: int = 0) -> int:
    if axis != 0:
        raise NkiError("nl.program_id: only axis 0 (the LNC launch) exists")
    return current().program_id


def num_programs(axes: int = 0) -> int:
    return current().lnc


def program_ndim() -> int:
    return 1 if current().lnc > 1 else 0


def _deprecated_range(name: str):
    def iterator(start, stop=None, step=1):
        warnings.warn(f"nl.{name} is deprecated in NKI 0.7 and defaults to Python range(); use range() (or "
                      "nl.fori_loop for large or run-time trip counts)", DeprecationWarning, stacklevel=2)
        return range(start, stop, step) if stop is not None else range(start)

    iterator.__name__ = name
    return iterator


affine_range = _deprecated_range("affine_range")
sequential_range = _deprecated_range("sequential_range")
static_range = _deprecated_range("static_range")

@contextlib.contextmanager
def no_reorder():
    """Instructions inside keep program order (the interpreter runs in program order anyway)."""
    run = current()
    run.no_reorder += 1
    try:
        yield
    finally:
        run.no_reorder -= 1


def _compiled_loop(name: str) -> None:
    if current().no_reorder:
        raise NkiError(f"nl.{name} inside nl.no_reorder() is not supported; put no_reorder inside the loop body")


def fori_loop(lower, upper, body_fun, step=1) -> None:
    """``for i in range(lower, upper, step): body_fun(i)`` as one compiled loop: ``i`` is an NkiScalar (a
    VirtualRegister when a bound is one), the step a positive compile-time int, the bounds 32-bit (docs:
    nki.language.fori_loop, 2.33)."""
    _compiled_loop("fori_loop")
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise NkiError(f"nl.fori_loop: step must be a positive compile-time int, got {step!r}")
    for b in (lower, upper):
        if isinstance(b, NkiScalar) and b.dtype != "int32":
            raise NkiError("nl.fori_loop: a bound must be 32-bit; an nl.int64 scalar cannot bound the loop (its "
                           "trip-count comparison has no 64-bit form)")
    lo, hi = runtime_value(lower, "nl.fori_loop lower"), runtime_value(upper, "nl.fori_loop upper")
    registers = isinstance(lower, VirtualRegister) or isinstance(upper, VirtualRegister)
    memory = current().memory
    memory.loop_start()
    try:
        for i in range(lo, hi, step):
            memory.iteration()
            body_fun(VirtualRegister(i) if registers else NkiScalar(i, "int32"))
    finally:
        memory.loop_end()


WHILE_LOOP_LIMIT = 1 << 20


def while_loop(init, body_fun) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` as one compiled loop; the body returns the next condition
    (docs: nki.language.while_loop)."""
    _compiled_loop("while_loop")
    memory = current().memory
    kind = type(init)
    value = runtime_value(init, "nl.while_loop init")
    memory.loop_start()
    try:
        n = 0
        while value != 0:
            n += 1
            if n > WHILE_LOOP_LIMIT:
                raise NkiError(f"nl.while_loop: more than {WHILE_LOOP_LIMIT} iterations; does the body update "
                               "the condition it returns?")
            memory.iteration()
            nxt = body_fun(VirtualRegister(value) if kind is VirtualRegister else NkiScalar(value, init.dtype))
            if not isinstance(nxt, (VirtualRegister, NkiScalar)):
                raise NkiError(f"nl.while_loop: the body must return the next condition register, got "
                               f"{type(nxt).__name__}")
            value = runtime_value(nxt, "nl.while_loop condition")
    finally:
        memory.loop_end()


# -- data movement helpers ---------------------------------------------------------------------------------------


def load(src: NkiTensor, dtype=None) -> NkiTensor:
    out = new_tensor(src.shape if len(src.shape) >= 2 else (1, *src.shape), dtype or src.dtype, "sbuf")
    isa.dma_copy(dst=out, src=src)
    return out


def store(dst: NkiTensor, value: NkiTensor) -> None:
    if value.buffer == "psum":
        raise NkiError("nl.store: the value is in PSUM; copy it to SBUF first (nisa.tensor_copy)")
    isa.dma_copy(dst=dst, src=value)


_ALIASES = {"bool": bool_, "dtype": str}
"""``nl.bool`` (the NKI Library's spelling of ``nl.bool_``) and ``nl.dtype``, the type of a dtype (dtypes are their
names here: ``str(nl.float32) == "float32"``, as the library compares them); module attributes only, so that this
module's own ``bool`` stays Python's."""


def __getattr__(name: str):
    try:
        return _ALIASES[name]
    except KeyError:
        raise AttributeError(f"nki.language has no attribute {name!r} in the interpreter") from None


__all__ = [n for n in dir() if not n.startswith("_")]
