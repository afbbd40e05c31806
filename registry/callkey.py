"""The key of a live call: the one place that reads tensors, for dispatch and the recorder alike."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import has_static_value

from .specs import Key, OpLike, TensorSpec


def raw_of(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """What the key depends on, cheaply and hashably: dispatch caches its decision on this. An absent optional
    tensor is None."""
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors])


def integer(value: Any) -> Any:
    """An integer attribute of a pack call, as PyTorch takes one (``operator.index``: a float is refused); a
    symbolic one (a size under dynamic shapes) stays symbolic, so the call takes the expression, rather than
    being read as an int, which would specialise the graph to its value."""
    if type(value) is int:  # the usual case, on every eager call
        return value
    symbolic_int = isinstance(value, (int, torch.SymInt)) and not has_static_value(value)  # Dynamo: SymInt is int
    return value if symbolic_int else operator.index(value)


def symbolic(raw: tuple, attrs: tuple) -> bool:
    """Whether a call traced with dynamic shapes has a symbolic size, stride or number among its attributes (a
    float that changes between calls is one): no key can be made of it. Under Dynamo a symbolic int passes for an
    int, ``isinstance`` included; ``has_static_value`` tells them apart."""
    dims = [d for r in raw if r is not None for d in (*r[0], *r[1])]
    numbers = [a for a in attrs if isinstance(a, (int, float))]
    return not all(has_static_value(v) for v in (*dims, *numbers))


def spec_of(raw: tuple | None, grad_enabled: bool) -> TensorSpec | None:
    if raw is None:
        return None
    shape, strides, dtype, _, requires_grad = raw
    return TensorSpec(tuple(shape), str(dtype).removeprefix("torch."), tuple(strides), requires_grad and grad_enabled)


def key_of_call(op: OpLike, raw: tuple, attrs: dict[str, Any], grad_enabled: bool) -> Key:
    """The key of one call: a gradient is needed only where grad mode is on and the tensor requires it."""
    return Key.of(op, tuple(spec_of(r, grad_enabled) for r in raw), attrs)


def devices_of(raw: tuple) -> set[str]:
    return {r[3].type for r in raw if r is not None}
