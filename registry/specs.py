"""What a call looks like, as plain hashable data (no torch import).

Tables and profiles are keyed by these; dispatch, the recorder and the autotuner
all build them the same way, so a key written by one is found by the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRAINING = "training"
INFERENCE = "inference"
MODES = (TRAINING, INFERENCE)

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
DTYPES = FLOAT_DTYPES + ("int64", "int32", "int16", "int8", "uint8", "bool")


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and layout of one tensor argument."""

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] | None = None  # None: contiguous
    device: str = "cpu"
    requires_grad: bool = False

    @property
    def contiguous_strides(self) -> tuple[int, ...]:
        out, step = [], 1
        for n in reversed(self.shape):
            out.append(step)
            step *= max(n, 1)
        return tuple(reversed(out))

    @property
    def layout(self) -> tuple[int, ...]:
        return self.contiguous_strides if self.strides is None else self.strides

    @property
    def is_contiguous(self) -> bool:
        if self.strides is None:
            return True
        return all(s == c for s, c, n in zip(self.strides, self.contiguous_strides, self.shape) if n > 1)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def attrs_key(attrs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(attrs.items()))


@dataclass(frozen=True)
class Key:
    """One unique call-site shape: what a table entry and a tuning study are about."""

    op: str
    mode: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    attrs: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(op: str, mode: str, specs: tuple[TensorSpec, ...], attrs: Mapping[str, Any]) -> Key:
        return Key(op, mode, tuple((s.shape, s.dtype) for s in specs), attrs_key(attrs))

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def specs(self) -> tuple[TensorSpec, ...]:
        """Contiguous specs of the inputs (the layout the autotuner benchmarks)."""
        return tuple(TensorSpec(tuple(s), d) for s, d in self.inputs)

    def label(self) -> str:
        shapes = ", ".join(f"{list(s)} {d}" for s, d in self.inputs)
        attrs = "".join(f", {k}={v}" for k, v in self.attrs)
        return f"{self.op}({shapes}{attrs}) {self.mode}"
