"""Numerics gate (docs/design.md §6.3): a candidate against the float64 reference, outputs and gradients."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..registry import Impl, Key, Op
from .inputs import carrying_gradients, laid_out, make_inputs

TOLERANCE = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 1e-2, "float16": 1e-3}


def tolerance(key: Key) -> float:
    """The loosest dtype among the float inputs sets the bar (float32 when there is none)."""
    tols = [TOLERANCE[s.dtype] for s in key.present if s.dtype in TOLERANCE]
    return max(tols, default=TOLERANCE["float32"])


@dataclass(frozen=True)
class Numerics:
    rel_err: float
    tolerance: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.rel_err == self.rel_err and self.rel_err <= self.tolerance  # NaN never passes


@contextmanager
def poisoned():
    """New allocations come filled with NaN (floats) or the max value (ints): unwritten output shows."""
    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
        torch.utils.deterministic.fill_uninitialized_memory = was_fill


# A float64 reference whose root-mean-square is below this, at the unit-scale inputs the gate draws, is zero up to
# its own rounding (a gradient that cancels exactly, as a query's over a single key): relative to it, the
# candidate's rounding would count as an error of 1e8.
ZERO_RMS = 1e-12


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The difference's norm over the reference's; against a reference that is zero (``ZERO_RMS``), its norm. Of
    an integer output (a loss's predicted classes): the share of its elements that differ."""
    if not ref.is_floating_point():
        return (got.detach().cpu() != ref).double().mean().item() if ref.numel() else 0.0
    got = got.detach().to("cpu", torch.float64)
    if not torch.isfinite(got).all():
        return float("nan")
    denom = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff if denom <= ZERO_RMS * ref.numel() ** 0.5 else diff / denom


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def compare(op: Op, key: Key, fn: Callable[..., tuple], gen: torch.Generator, device: str = "cpu",
            samples: dict | None = None) -> Numerics:
    """Run ``fn`` (the candidate: tensors -> outputs) and the float64 reference on the same fresh inputs, in the
    key's layouts; gradients are compared for the inputs whose gradient the key asks for (an absent optional
    input is None on both sides, with nothing to compare)."""
    inputs = make_inputs(op, key, gen, samples)
    diff = list(key.grads)
    attrs = tuple(key.attr_dict[a] for a in op.attrs)

    ref_in = [None if t is None else t.detach().double().requires_grad_(i in diff) if t.is_floating_point()
              else t.detach() for i, t in enumerate(inputs)]
    ref_out = _outputs(op.reference(*ref_in, *attrs))
    grad_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    # the output gradients as the candidate gets them (rounded to the key's loosest dtype) on both sides: a gradient
    # summed from a few rounded seeds that cancel is the exact answer to the question the candidate was asked
    low = getattr(torch, max((s.dtype for s in key.present if s.dtype in TOLERANCE), key=TOLERANCE.get,
                             default="float64"))
    seeds = [torch.randn(o.shape, generator=grad_gen, dtype=torch.float64).to(low).double() for o in ref_out]
    ref_starts, ref_seeds = carrying_gradients(ref_out, seeds)
    ref_grads = torch.autograd.grad(ref_starts, [ref_in[i] for i in diff], ref_seeds) if diff else ()

    cand_in = [None if t is None else laid_out(t.detach().to(device), s).requires_grad_(i in diff)
               for i, (t, s) in enumerate(zip(inputs, key.inputs))]
    with poisoned():
        out = fn(*cand_in)
        starts, starts_seeds = carrying_gradients(out, [s.to(device, o.dtype) for s, o in zip(seeds, out)])
        grads = torch.autograd.grad(starts, [cand_in[i] for i in diff], starts_seeds) if diff else ()
    errs = [(f"output {i}", rel_err(o, r.detach())) for i, (o, r) in enumerate(zip(out, ref_out))]
    errs += [(f"grad {op.tensors[i]}", rel_err(g, r)) for i, g, r in zip(diff, grads, ref_grads)]
    worst_name, worst = max(errs, key=lambda e: float("inf") if e[1] != e[1] else e[1])
    return Numerics(worst, tolerance(key), f"worst: {worst_name}" if errs else "")


def check_impl(impl: Impl, key: Key, config: dict, gen: torch.Generator, device: str = "cpu",
               samples: dict | None = None) -> Numerics:
    """The numerics of one impl at one config, called through its custom op (told the key's needs)."""
    op, attrs, cfg = impl.op, tuple(key.attr_dict[a] for a in impl.op.attrs), impl.call_args(config, key)
    n_res = op.outputs + impl.saved

    def fn(*ts):
        out = impl.fwd_op(*ts, *attrs, *cfg)
        return (out,) if n_res == 1 else tuple(out[:op.outputs])

    return compare(op, key, fn, gen, device, samples)
