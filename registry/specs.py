"""What a call looks like, as plain hashable data (no torch import).

A key is what a table entry, a tuning study and a dispatch decision are about: the op, the mode, and per
tensor argument its shape, dtype, layout and whether the call needs its gradient, then the attributes.
``Key.of`` is the one rule that turns tensor specs into a key; the recorder, dispatch and the autotuner all
go through it (dispatch and the recorder by way of ``callkey.key_of_call``), so a key written by one is
found by the others.

Layout: ``strides`` is None for a contiguous (row-major) tensor, else its strides exactly, except that the
stride of a dim of size 1 is replaced by its contiguous value (it never addresses memory). A transposed view
(Hugging Face's q/k) is therefore a different key from its contiguous copy, and is benchmarked as such.

An optional tensor argument (``Op.optional``) that a call leaves out is None in the key's ``inputs``: a call with
it and one without are different keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

TRAINING = "training"
INFERENCE = "inference"
MODES = (TRAINING, INFERENCE)

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
DTYPES = FLOAT_DTYPES + ("int64", "int32", "int16", "int8", "uint8", "bool")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and layout of one tensor argument, and whether this call needs its gradient."""

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None
    """None: contiguous. Normalised on construction (see the module doc), so equal layouts compare equal."""
    requires_grad: bool = False
    """The call needs this input's gradient: grad mode was on and the tensor required grad."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.strides is not None:
            if len(self.strides) != len(self.shape):
                raise ValueError(f"strides {list(self.strides)} do not match shape {list(self.shape)}")
            c = contiguous_strides(self.shape)
            s = tuple(ci if n == 1 else int(si) for si, ci, n in zip(self.strides, c, self.shape))
            object.__setattr__(self, "strides", None if s == c or self.numel == 0 else s)

    @property
    def layout(self) -> tuple[int, ...]:
        """The strides, contiguous ones spelled out."""
        return contiguous_strides(self.shape) if self.strides is None else self.strides

    @property
    def is_contiguous(self) -> bool:
        return self.strides is None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def label(self) -> str:
        out = f"{list(self.shape)} {self.dtype}"
        if self.strides is not None:
            out += f" strides={list(self.strides)}"
        return out + (" grad" if self.requires_grad else "")


def short(spec: TensorSpec | None) -> str:
    """An input's shape in a few characters (``8x512``, ``()`` for a scalar), or ``None`` where it is absent."""
    return "None" if spec is None else "x".join(map(str, spec.shape)) or "()"


class OpLike(Protocol):
    """What the key rule needs of an op (``registry.Op`` has it)."""

    name: str
    tensors: tuple[str, ...]
    differentiable: tuple[str, ...]
    optional: tuple[str, ...]


def none_refused(op: OpLike, j: int) -> str | None:
    """Why ``op``'s tensor argument ``j`` cannot be None (``null`` in a file), or None where it is optional."""
    name = op.tensors[j]
    if name in op.optional:
        return None
    return (f"{op.name}'s tensor {name} is required, so it cannot be None (null); optional tensors of {op.name}: "
            f"{', '.join(op.optional) or 'none'}")


def attrs_key(attrs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(attrs.items()))


@dataclass(frozen=True)
class Key:
    """One unique call: what a table entry and a tuning study are about."""

    op: str
    mode: str
    inputs: tuple[TensorSpec | None, ...]
    """Per tensor argument of the op, its spec; None for an optional one the call leaves out."""
    attrs: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(op: OpLike, specs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], mode: str | None = None) -> Key:
        """The key of a call of ``op`` on ``specs``: the one rule for mode and gradients.

        Only differentiable floating-point inputs can need a gradient; the mode is training where one does.
        ``mode`` overrides: inference drops every gradient; training keeps the recorded ones, or (where none was
        recorded) asks for every differentiable input's. An op with nothing to differentiate stays inference.
        None stands for an absent optional tensor, which needs nothing; at a required position it is an error.
        An attribute not given takes the op's default (``defaults``), as in profiles and tables: a key written before
        an op gained an attribute (rmsnorm's offset) is the key of the same call.
        """
        attrs = {**getattr(op, "defaults", {}), **attrs}
        for j, s in enumerate(specs):
            why = none_refused(op, j) if s is None else None
            if why is not None:
                raise ValueError(why)
        can = tuple(name in op.differentiable and s is not None and s.is_float for name, s in zip(op.tensors, specs))
        grads = tuple(c and s.requires_grad for c, s in zip(can, specs))
        if mode == INFERENCE:
            grads = (False,) * len(specs)
        elif mode == TRAINING and not any(grads):
            grads = can
        specs = tuple(s if s is None or s.requires_grad == g else replace(s, requires_grad=g)
                      for s, g in zip(specs, grads))
        return Key(op.name, TRAINING if any(grads) else INFERENCE, specs, attrs_key(attrs))

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def grads(self) -> tuple[int, ...]:
        """Positions of the inputs whose gradients this key asks for."""
        return tuple(i for i, s in enumerate(self.inputs) if s is not None and s.requires_grad)

    def needs(self, op: OpLike) -> tuple[bool, ...]:
        """Per ``op.differentiable``, whether this key asks for its gradient: what a ``forward_needs`` impl's
        forward is told (``Impl.call_args``)."""
        grads = self.grads
        return tuple(op.tensors.index(n) in grads for n in op.differentiable)

    @property
    def present(self) -> list[TensorSpec]:
        """The specs of the tensors the call passes (absent optional ones left out)."""
        return [s for s in self.inputs if s is not None]

    def label(self) -> str:
        shapes = ", ".join("None" if s is None else s.label() for s in self.inputs)
        attrs = "".join(f", {k}={v}" for k, v in self.attrs)
        return f"{self.op}({shapes}{attrs}) {self.mode}"

    def differences(self, other: Key) -> list[str]:
        """The fields in which ``other`` differs from this key, for people ("layout of input 0", ...)."""
        out = [f for f in ("op", "mode") if getattr(self, f) != getattr(other, f)]
        if len(self.inputs) != len(other.inputs):
            return out + ["number of inputs"]
        for i, (a, b) in enumerate(zip(self.inputs, other.inputs)):
            if a is None or b is None:
                if (a is None) != (b is None):
                    out.append(f"presence of input {i}")
                continue
            for field, what in (("shape", "shape"), ("dtype", "dtype"), ("strides", "layout"),
                                ("requires_grad", "gradient")):
                if getattr(a, field) != getattr(b, field):
                    out.append(f"{what} of input {i}")
        if self.attrs != other.attrs:
            out.append("attrs")
        return out
