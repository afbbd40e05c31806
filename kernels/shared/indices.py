"""Realistic index tensors for benchmarks: uniform or Zipf-skewed, sorted or not, or the profile's samples."""

from __future__ import annotations

import torch


def make_index(shape: tuple[int, ...], size: int, gen: torch.Generator, dist: str = "uniform",
               sort: bool = False) -> torch.Tensor:
    """Indices in [0, size): ``uniform``, or ``zipf`` (exponent 1.1 over a shuffled ranking, as token ids)."""
    n = 1
    for s in shape:
        n *= s
    if n == 0 or size == 0:  # nothing to draw (an index into nothing can only be empty)
        idx = torch.zeros(n, dtype=torch.int64)
    elif dist == "zipf":
        ranks = torch.arange(1, size + 1, dtype=torch.float64)
        idx = torch.multinomial(ranks.pow(-1.1), n, replacement=True, generator=gen)
        idx = torch.randperm(size, generator=gen)[idx]
    elif dist == "uniform":
        idx = torch.randint(0, size, (n,), generator=gen)
    else:
        raise ValueError(f"dist={dist!r}; use 'uniform' or 'zipf'")
    if sort:
        idx = idx.sort().values
    return idx.reshape(shape)


def sample_or(samples: dict | None, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The captured real tensor ``name`` when its shape matches the key's."""
    if samples is not None and name in samples and tuple(samples[name].shape) == tuple(shape):
        return samples[name].clone()
    return None
