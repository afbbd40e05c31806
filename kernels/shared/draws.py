"""Sizes for ops' ``draw`` (docs/adding-an-op.md): fresh calls for the pack's generic tests."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_SMALL: ContextVar[bool] = ContextVar("small", default=False)


@contextmanager
def small() -> Iterator[None]:
    """Within it, every size is from 0 to 5 (empty tensors and single elements the edges): the tests that draw
    many calls and poke special values into each."""
    token = _SMALL.set(True)
    try:
        yield
    finally:
        _SMALL.reset(token)


def size(rng: random.Random, most: int) -> int:
    """1 one time in five (the edge every kernel takes), else anything up to ``most``; within ``small()``, 0 to 5."""
    if _SMALL.get():
        return rng.randint(0, min(most, 5))
    return 1 if rng.random() < 0.2 else rng.randint(1, most)


def rows(rng: random.Random, width: int, most: int = 200) -> tuple[int, ...]:
    """A shape [..., width]: one or two leading dims of together up to about ``most`` rows."""
    if rng.random() < 0.3:
        return (size(rng, 3), size(rng, max(1, most // 3)), width)
    return (size(rng, most), width)


__all__ = ["rows", "size", "small"]
