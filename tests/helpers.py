"""Numerics helpers for tests: float64 references and relative errors."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The numerics gate's relative error (a reference that is zero up to its rounding, as a gradient that cancels
    exactly, compared absolutely), of finite values only."""
    from nki_autotune.autotune.numerics import rel_err as gate

    assert torch.isfinite(got.double()).all(), "non-finite values"
    return gate(got, ref.double())


def run_with_grads(fn, inputs: tuple, grad_out_seed: int = 0, grad_dtype: torch.dtype | None = None,
                   wants: tuple[str, ...] | None = None, names: tuple[str, ...] = ()):
    """Outputs of ``fn(*inputs)`` and the gradients of a random projection of them w.r.t. float inputs (those
    named in ``wants`` only, where given with the inputs' ``names``; None inputs pass as they are).
    ``grad_dtype`` rounds the projection (the outputs' gradient) to that dtype first: a float64 reference given
    the gradient a bfloat16 output receives, so a reduced gradient's error is the kernel's, not the rounding of
    its input amplified by cancellation."""
    def needs(j: int, t) -> bool:
        return t is not None and t.is_floating_point() and (wants is None or names[j] in wants)

    leaves = tuple(t if t is None else t.detach().clone().requires_grad_(needs(j, t)) for j, t in enumerate(inputs))
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(grad_out_seed)
    seeds = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    if grad_dtype is not None:
        seeds = [s.to(grad_dtype).double() for s in seeds]
    loss = sum((o.double() * s).sum() for o, s in zip(outs, seeds) if o.requires_grad)  # not a detached output
    loss.backward()
    return outs, tuple(t.grad for j, t in enumerate(leaves) if needs(j, t))


def as64(inputs: tuple) -> tuple:
    return tuple(t.double() if t is not None and t.is_floating_point() else t for t in inputs)


def _nudged(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` with each element moved by up to two float32 ulps (integer tensors unchanged)."""
    if t is None or not t.is_floating_point():
        return t
    ulps = torch.randint(-2, 3, t.shape, generator=gen).double()
    return (t.double() * (1 + ulps * 2.0**-24)).to(t.dtype)


def float32_floor(fn, inputs: tuple, copies: int = 4, seed: int = 0, **which) -> float:
    """The worst relative error, outputs and gradients, of ``fn`` itself run in float32 on copies of ``inputs``
    nudged by an ulp or two, against ``fn`` in float64: what float32 can promise on these inputs. It is far
    above 1e-5 on a peaked softmax row or a confident cross-entropy target, where PyTorch's own float32
    formulas cancel."""
    ref_outs, ref_grads = run_with_grads(fn, as64(inputs), **which)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(copies):
        outs, grads = run_with_grads(fn, tuple(_nudged(t, gen) for t in inputs), **which)
        worst = max([worst] + [rel_err(o, r) for o, r in zip(outs, ref_outs)]
                    + [rel_err(g, r) for g, r in zip(grads, ref_grads)])
    return worst


def key_of(op: str, mode: str, inputs, attrs=()):
    """The key of ``op`` on inputs given as (shape, dtype) pairs, or (shape, dtype, strides) (None for an absent
    optional one), in ``mode`` (``Key.of``'s rule); attributes not given take the op's defaults."""
    from nki_autotune.registry import Key, TensorSpec, get_op

    specs = tuple(None if x is None else TensorSpec(tuple(x[0]), x[1], *x[2:]) for x in inputs)
    return Key.of(get_op(op), specs, {**get_op(op).defaults, **dict(attrs)}, mode)
