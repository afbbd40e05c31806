"""RMSNorm: the numba kernel vs Inductor's code, forward and forward+backward, at a spread of shapes.

Each candidate runs inside its own compiled region, exactly as in the autotuner (one call per region;
the region's fixed cost is the `empty` benchmark of the same mode, to subtract when comparing).
Run: make bench   (or: pytest benchmarks -k rmsnorm --benchmark-group-by=param:shape,param:mode)
"""

from __future__ import annotations

import time

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.autotune.timing import Workload
from nki_autotune.registry import Key, TensorSpec, explain, get_backend, get_op, scope

OP = get_op("rmsnorm")
IMPL = OP.impls["cpu_rows"]
CPU = get_backend("cpu")
SHAPES = [(8, 64), (512, 256), (2048, 64), (2048, 512), (8192, 1024)]
MODES = ["inference", "training"]
CONFIG = {"threads": CPU.fingerprint()["threads"], "rows_per_task": 64}


def _key(shape, mode):
    return Key.of(OP, (TensorSpec(shape, "float32"), TensorSpec(shape[-1:], "float32")), {"eps": 1e-6}, mode)


def _bench(benchmark, runner, shape):
    i = iter(range(1 << 30))
    benchmark.pedantic(lambda: runner.step(next(i)), rounds=30, warmup_rounds=3, iterations=1)
    n = shape[0] * shape[1]
    benchmark.extra_info["bytes"] = 2 * n * 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("candidate", ["compiler", "cpu_rows", "empty"])
def test_rmsnorm(benchmark, shape, mode, candidate):
    key = _key(shape, mode)
    benchmark.group = f"rmsnorm {'x'.join(map(str, shape))} {mode}"
    if candidate == "cpu_rows":  # verify as we measure
        res = check_impl(IMPL, key, CONFIG, torch.Generator().manual_seed(0))
        assert res.ok, res
    w = Workload(OP, key, CPU, sets=2)
    w.prepare(1)
    runner = {"compiler": w.compiler, "empty": w.empty, "cpu_rows": lambda: w.kernel(IMPL, CONFIG)}[candidate]()
    _bench(benchmark, runner, shape)


@pytest.mark.parametrize("path", ["nk.rmsnorm", "custom op"])
def test_eager_dispatch_overhead(benchmark, path):
    """Calling the pack's function vs calling the chosen custom op directly (the difference is dispatch)."""
    x, w = torch.randn(4, 32), torch.randn(32)
    benchmark.group = "eager dispatch overhead"
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        exp = explain("rmsnorm", x, w)
        assert exp.impl == "cpu_rows"
        cfg = tuple(exp.config.values())
        fn = (lambda: nk.rmsnorm(x, w)) if path == "nk.rmsnorm" else (lambda: IMPL.fwd_op(x, w, 1e-6, *cfg)[0])
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
