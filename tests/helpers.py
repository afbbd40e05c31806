"""Numerics helpers for tests: float64 references and relative errors."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), "non-finite values"
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def run_with_grads(fn, inputs: tuple, grad_out_seed: int = 0):
    """Outputs of ``fn(*inputs)`` and the gradients of a random projection of them w.r.t. float inputs."""
    leaves = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(grad_out_seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs)
    loss.backward()
    return outs, tuple(t.grad for t in leaves if t.is_floating_point())


def as64(inputs: tuple) -> tuple:
    return tuple(t.double() if t.is_floating_point() else t for t in inputs)
