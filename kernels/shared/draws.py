"""Sizes for ops' ``draw`` (docs/adding-an-op.md): fresh calls for the pack's generic tests."""

from __future__ import annotations

import random


def size(rng: random.Random, most: int) -> int:
    """1 one time in five (the edge every kernel takes), else anything up to ``most``."""
    return 1 if rng.random() < 0.2 else rng.randint(1, most)


def rows(rng: random.Random, width: int, most: int = 200) -> tuple[int, ...]:
    """A shape [..., width]: one or two leading dims of together up to about ``most`` rows."""
    n = size(rng, most)
    if rng.random() < 0.3:
        return (rng.randint(1, 3), max(1, n // 3), width)
    return (n, width)


__all__ = ["rows", "size"]
