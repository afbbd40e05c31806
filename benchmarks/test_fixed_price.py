"""The fixed price of a kernel call: what a call through the registry costs beside its kernel's work.

An identity op (``x.clone()``, backward ``g.clone()``) is registered through the same path as the pack's ops
(``register_op`` / ``register_impl``: its own custom operator, fake, autograd backward) and called through the
pack's dispatch (``call``), at 8 x 64. Each region is timed against the same region without the op
(``x * 2`` vs ``identity(x) * 2``): compiled (``fullgraph=True``) and eager, forward and forward+backward.
Next to it, a real kernel at a tiny shape: ``rmsnorm`` 8 x 64 in a compiled region, its kernel's op (one thread,
as a table chooses at this shape) vs the compiler's code; and ``nk.rmsnorm`` compiled under
``NKI_AUTOTUNE_KERNELS=on``, the impl's default config fitted to the call (``SERIAL_BELOW``), vs kernels off.
Every variant is timed in one run, interleaved in an order shuffled every round; the price is the median of the
per-round differences, with its 95% interval.

Run: ``pytest benchmarks/test_fixed_price.py -s`` (part of ``make bench``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

import nki_autotune.kernels as nk
from nki_autotune.autotune.stats import median, paired_difference
from nki_autotune.autotune.timing import fresh
from nki_autotune.registry import Impl, Op, call, explain, get_op, register_impl, register_op, scope

RMSNORM = get_op("rmsnorm")

SHAPE = (8, 64)
ROUNDS, CALLS = 60, 20
TARGET_US = {"forward": 30.0, "forward+backward": 60.0}
"""The most a compiled region's fixed price may be (medians, on the project's 2-core machines)."""


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


IDENTITY = register_op(Op(name="fixed_price_identity", reference=_identity, tensors=("x",), differentiable=("x",)))
register_impl(Impl(
    op=IDENTITY, name="cpu_clone", backend="cpu", supports=lambda specs, attrs: None,
    forward=lambda tensors, attrs, config: (tensors[0].clone(),),
    backward=lambda grads, tensors, results, attrs, config, needs: (grads[0].clone(),),
    fake=lambda tensors, attrs: (torch.empty_like(tensors[0]),), reads={"x": ()},
))


def _base(x):
    return x * 2.0


def _with_identity(x):
    return call(IDENTITY, (x,), ()) * 2.0


def _rmsnorm_compiler(x, w):
    return RMSNORM.reference(x, w, 1e-6)


def _rmsnorm_kernel(x, w):  # what dispatch puts in the graph, with the config a table gives a tiny shape
    return RMSNORM.impls["cpu_rows"].fwd_op(x, w, 1e-6, 0.0, 1, 16)[0]


def _variants() -> tuple[dict[str, Callable[[], object]], object]:
    """name -> one call (the forward+backward ones take gradients of a fixed random seed); and what ``on`` runs."""
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    w = 1 + 0.1 * torch.randn(SHAPE[-1], generator=gen)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out: dict[str, Callable[[], object]] = {}
    for mode in ("compiled", "eager"):
        for name, fn in (("without", _base), ("with", _with_identity)):
            f = torch.compile(fresh(fn), fullgraph=True, dynamic=False) if mode == "compiled" else fn
            out[f"identity {mode} forward {name}"] = lambda f=f: f(x)
            out[f"identity {mode} forward+backward {name}"] = lambda f=f: torch.autograd.grad(f(xg), xg, g)
    for name, fn in (("without", _rmsnorm_compiler), ("with", _rmsnorm_kernel)):
        f = torch.compile(fresh(fn), fullgraph=True, dynamic=False)
        out[f"rmsnorm compiled forward {name}"] = lambda f=f: f(x, w)
        out[f"rmsnorm compiled forward+backward {name}"] = lambda f=f: torch.autograd.grad(f(xg, wg), (xg, wg), g)
    on = explain("rmsnorm", xg, wg, 1e-6)  # the caller holds NKI_AUTOTUNE_KERNELS=on; a training call's config
    assert on.path == "kernel", on
    for name, fn in (("without", _rmsnorm_compiler), ("with", lambda x, w: nk.rmsnorm(x, w, 1e-6))):
        f = torch.compile(fresh(fn), fullgraph=True, dynamic=False)
        out[f"rmsnorm under on forward {name}"] = lambda f=f: f(x, w)
        out[f"rmsnorm under on forward+backward {name}"] = lambda f=f: torch.autograd.grad(f(xg, wg), (xg, wg), g)
    return out, on


def _interleaved(variants: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per round (the mean of CALLS calls)."""
    for fn in variants.values():  # compile and warm up
        for _ in range(CALLS):
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    rng = random.Random(0)
    for _ in range(ROUNDS):
        rng.shuffle(order)
        for k in order:
            fn = variants[k]
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times[k].append((time.perf_counter() - t0) / CALLS)
    return times


def test_fixed_price_of_a_kernel_call(capsys):
    with scope(NKI_AUTOTUNE_KERNEL_FIXED_PRICE_IDENTITY="on", NKI_AUTOTUNE_KERNELS="on"):  # held: dynamo guards on it
        variants, on = _variants()
        times = _interleaved(variants)
    rows = []
    for what in ("identity compiled", "identity eager", "rmsnorm compiled", "rmsnorm under on"):
        for mode in ("forward", "forward+backward"):
            a, b = times[f"{what} {mode} with"], times[f"{what} {mode} without"]
            price, (lo, hi) = paired_difference(a, b)
            target = f"target <= {TARGET_US[mode]:.0f} us" if what != "identity eager" else ""
            rows.append((what, mode, median(b), median(a), price, lo, hi, target))
    with capsys.disabled():
        print(f"\nfixed price of a kernel call at {'x'.join(map(str, SHAPE))} (medians of {ROUNDS} interleaved rounds "
              f"of {CALLS} calls; price = median of per-round differences, 95% CI)")
        print("  (rmsnorm compiled: the one-thread config a table gives this shape; rmsnorm under on: what "
              f"NKI_AUTOTUNE_KERNELS=on runs, {on.impl} {dict(on.config)}, against it off)")
        print(f"  {'':<18} {'':<17} {'without':>9} {'with':>9} {'price':>9}  {'95% CI':<13}")
        for what, mode, without, with_, price, lo, hi, target in rows:
            print(f"  {what:<18} {mode:<17} {without * 1e6:7.1f}us {with_ * 1e6:7.1f}us {price * 1e6:7.1f}us  "
                  f"{lo * 1e6:5.1f}-{hi * 1e6:5.1f}  {target}")
    assert get_op("fixed_price_identity").impls["cpu_clone"].fwd_op is not None
