"""Every op the pack finds: each CPU kernel vs Inductor's code, forward and forward+backward, at the call sites its
folder names (``Op.benchmarks``), with the bandwidth each kernel achieves next to this machine's copy bandwidth and,
in training mode, the peak memory of each (see conftest's summary).

Kernel and compiler are timed in one run, interleaved round by round in a shuffled order, each in its own compiled
region (one call per region, the kernel at its default config), as the autotuner times them; the kernel's numerics
are checked against float64 before it is timed.
Run: make bench   (or: pytest benchmarks/test_pack.py -k softmax)
"""

from __future__ import annotations

import time

import pytest
import torch

from nki_autotune.autotune.memory import peak_bytes
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.autotune.stats import median, ratio_of_medians
from nki_autotune.autotune.timing import Clock, Workload, interleave
from nki_autotune.kernels import OPS
from nki_autotune.registry import Key, TensorSpec, get_backend, get_op

from .conftest import COPY, RESULTS, Result

CPU = get_backend("cpu")
ROUNDS = 15

CASES = [(name, *case) for name in OPS for case in get_op(name).benchmarks]
"""Every op the pack finds, at the call sites its folder names (``Op.benchmarks``)."""


def _spec(i):
    """An input (shape, dtype[, strides[, requires_grad]]) as a spec; None for an absent optional tensor."""
    return None if i is None else TensorSpec(tuple(i[0]), *i[1:])


def _bytes(name, inputs, attrs, training):
    """The bytes the op moves, counted from its signature alone: its inputs and outputs whole; in training also
    the output gradients, the inputs read again by the backward and the input gradients (of the differentiable
    floating inputs). The outputs' sizes come from the reference on meta tensors. A gather reads only the rows it
    needs (embedding's table, a sparse scatter's gradient): its bandwidth reads high."""
    op = get_op(name)
    tensors = [None if i is None else torch.empty(i[0], dtype=getattr(torch, i[1]), device="meta") for i in inputs]
    values = {**op.defaults, **attrs}
    outs = op.reference(*tensors, *(values[a] for a in op.attrs))
    outs = outs if isinstance(outs, tuple) else (outs,)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    ins, out = size(tensors), size(outs)
    if not training:
        return ins + out
    grads = [t for n, t in zip(op.tensors, tensors)
             if n in op.differentiable and t is not None and t.is_floating_point()]
    return 2 * ins + 2 * out + size(grads)


def _label(case):
    name, inputs, attrs, opts = case
    shapes = "/".join("-" if i is None else "x".join(map(str, i[0])) + (" (HF view)" if len(i) > 2 and i[2] else "")
                      for i in inputs)
    extra = "".join(f" {k}={v}" for k, v in [*attrs.items(), *opts.items()])
    return f"{name} {shapes}{extra}"


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("case", CASES, ids=_label)
def test_op(case, mode):
    name, inputs, attrs, opts = case
    op = get_op(name)
    impl = next(i for i in op.impls.values() if i.backend == "cpu")
    key = Key.of(op, tuple(_spec(i) for i in inputs), dict(attrs), mode)
    config = impl.default if impl.allows(impl.default, key) else impl.configs(key)[0]
    res = check_impl(impl, key, config, torch.Generator().manual_seed(0))
    assert res.ok, res  # verify as we measure
    w = Workload(op, key, CPU, sets=2, options=opts)
    w.prepare(1)
    compiler, kernel = w.compiler(), w.kernel(impl, config)
    times = interleave([compiler, kernel], rounds=ROUNDS, clock=Clock(CPU.synchronize), warmup=2)
    speedup, ci = ratio_of_medians(times["compiler"], times[kernel.name])
    peaks = (peak_bytes(lambda: compiler.step(0)), peak_bytes(lambda: kernel.step(0))) if key.grads else (None, None)
    RESULTS.append(Result(_label(case), mode, median(times["compiler"]), median(times[kernel.name]), speedup, ci,
                          _bytes(name, inputs, attrs, bool(key.grads)), *peaks))


def test_copy_bandwidth():
    """This machine's copy bandwidth in the same run: the yardstick of the kernels' bandwidth."""
    src = torch.randn(16 << 20)  # 64 MiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    COPY.append(2 * src.numel() * 4 / median(times))
