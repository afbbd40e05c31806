"""The eager call path of ``nk.rmsnorm``: the pack's function against its chosen custom op, and the dispatch layer
alone. (The kernel against the compiler, per shape and mode, is in test_pack.py.)
Run: make bench   (or: pytest benchmarks/test_rmsnorm.py)
"""

from __future__ import annotations

import time

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.registry import explain, get_backend, get_op, scope

OP = get_op("rmsnorm")
IMPL = OP.impls["cpu_rows"]
CPU = get_backend("cpu")


@pytest.mark.parametrize("path", ["nk.rmsnorm", "custom op"])
def test_eager_dispatch_overhead(benchmark, path):
    """Calling the pack's function vs calling the chosen custom op directly (the difference is dispatch)."""
    x, w = torch.randn(4, 32), torch.randn(32)
    benchmark.group = "eager dispatch overhead"
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        exp = explain("rmsnorm", x, w)
        assert exp.impl == "cpu_rows"
        cfg = tuple(exp.config.values())
        fn = (lambda: nk.rmsnorm(x, w)) if path == "nk.rmsnorm" else (lambda: IMPL.fwd_op(x, w, 1e-6, 0.0, *cfg)[0])
        torch.testing.assert_close(fn(), OP.reference(x, w, 1e-6))
        benchmark.pedantic(fn, rounds=2000, warmup_rounds=100, iterations=1)


@pytest.mark.parametrize("path", ["nk.rmsnorm", "direct"])
def test_dispatch_layer_alone(benchmark, path, monkeypatch):
    """The dispatch layer on its own: the chosen op replaced by a trivial function, so the custom op's own
    cost (and its noise) drops out; nk.rmsnorm minus direct is the per-call cost of dispatch."""
    x, w = torch.randn(4, 32), torch.randn(32)
    out = (x, x)

    def trivial(*args):
        return out

    monkeypatch.setattr(IMPL, "fwd_op", trivial)
    benchmark.group = "dispatch layer alone"
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        cfg = tuple(explain("rmsnorm", x, w).config.values())
        fn = (lambda: nk.rmsnorm(x, w)) if path == "nk.rmsnorm" else (lambda: trivial(x, w, 1e-6, *cfg)[0])
        assert fn() is x
        benchmark.pedantic(fn, rounds=20000, warmup_rounds=1000, iterations=1)


def test_clock_resolution():
    """perf_counter must resolve the smallest times above (a few microseconds)."""
    t0 = time.perf_counter()
    t1 = time.perf_counter()
    while t1 == t0:
        t1 = time.perf_counter()
    assert t1 - t0 < 1e-6
