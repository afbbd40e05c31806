"""The pack's ops: each CPU kernel vs Inductor's code, forward and forward+backward, at small and large shapes,
with the bandwidth each achieves next to this machine's copy bandwidth (see conftest's summary).

Each candidate runs in its own compiled region, one call per region, as the autotuner times it.
Run: make bench   (or: pytest benchmarks/test_pack.py -k softmax)
"""

from __future__ import annotations

import math

import pytest
import torch

import nki_autotune.kernels  # noqa: F401
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.autotune.timing import Workload
from nki_autotune.registry import Key, TensorSpec, get_backend, get_op

from .conftest import record

CPU = get_backend("cpu")
F32, I64 = 4, 8


def _key(op, mode, inputs, attrs=()):
    return Key.of(get_op(op), tuple(TensorSpec(tuple(s), d) for s, d in inputs), dict(attrs), mode)


def _n(shape):
    return math.prod(shape)


CE_ATTRS = [("ignore_index", -100), ("reduction", "mean")]

# op, inputs, attrs, generator options, bytes (inference), bytes (training: forward + backward)
CASES = [
    ("softmax", [((256, 128), "float32")], [("dim", -1)], {}, lambda s: 2 * F32 * _n(s[0]),
     lambda s: 5 * F32 * _n(s[0])),
    ("softmax", [((8, 4, 256, 256), "float32")], [("dim", -1)], {}, lambda s: 2 * F32 * _n(s[0]),
     lambda s: 5 * F32 * _n(s[0])),
    ("swiglu", [((64, 256), "float32")] * 2, [], {}, lambda s: 3 * F32 * _n(s[0]), lambda s: 8 * F32 * _n(s[0])),
    ("swiglu", [((2048, 2048), "float32")] * 2, [], {}, lambda s: 3 * F32 * _n(s[0]), lambda s: 8 * F32 * _n(s[0])),
    ("rope", [((8, 8, 512, 64), "float32")] * 2 + [((8, 512, 64), "float32")] * 2, [], {},
     lambda s: F32 * (4 * _n(s[0]) + 2 * _n(s[2])), lambda s: F32 * (10 * _n(s[0]) + 6 * _n(s[2]))),
    ("cross_entropy", [((64, 2048), "float32"), ((64,), "int64")], CE_ATTRS, {},
     lambda s: F32 * _n(s[0]), lambda s: 3 * F32 * _n(s[0])),
    ("cross_entropy", [((2048, 32000), "float32"), ((2048,), "int64")], CE_ATTRS, {},
     lambda s: F32 * _n(s[0]), lambda s: 3 * F32 * _n(s[0])),
] + [
    ("embedding", [((8, 1024), "int64"), ((32000, 512), "float32")], [("padding_idx", None)],
     {"dist": dist, "sort": sort},
     lambda s: I64 * _n(s[0]) + 2 * F32 * _n(s[0]) * s[1][1],
     lambda s: I64 * _n(s[0]) + 3 * F32 * _n(s[0]) * s[1][1] + F32 * _n(s[1]))
    for dist in ("uniform", "zipf") for sort in (False, True)
] + [
    ("segment_sum", [((65536, 64), "float32"), ((65536,), "int64")], [("num_segments", 4096)],
     {"dist": dist, "sort": sort},
     lambda s: F32 * _n(s[0]) + I64 * s[1][0] + F32 * 4096 * s[0][1],
     lambda s: 2 * F32 * _n(s[0]) + 2 * I64 * s[1][0] + 2 * F32 * 4096 * s[0][1])
    for dist in ("uniform", "zipf") for sort in (False, True)
]


def _label(case):
    op, inputs, _, opts, _, _ = case
    shapes = "/".join("x".join(map(str, s)) for s, _ in inputs)
    extra = "".join(f" {k}={v}" for k, v in opts.items())
    return f"{op} {shapes}{extra}"


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("case", CASES, ids=_label)
@pytest.mark.parametrize("candidate", ["compiler", "kernel"])
def test_op(benchmark, case, mode, candidate):
    name, inputs, attrs, opts, bytes_inf, bytes_train = case
    op = get_op(name)
    impl = next(i for i in op.impls.values() if i.backend == "cpu")
    key = _key(name, mode, inputs, attrs)
    group = f"{_label(case)} {mode}"
    benchmark.group = group
    w = Workload(op, key, CPU, sets=2, options=opts)
    w.prepare(1)
    if candidate == "kernel":
        config = impl.default if impl.allows(impl.default, key) else impl.configs(key)[0]
        assert check_impl(impl, key, config, torch.Generator().manual_seed(0)).ok  # verify as we measure
        runner = w.kernel(impl, config)
    else:
        runner = w.compiler()
    i = iter(range(1 << 30))
    benchmark.pedantic(lambda: runner.step(next(i)), rounds=15, warmup_rounds=2, iterations=1)
    shapes = [s for s, _ in inputs]
    record(benchmark, group, candidate, (bytes_train if mode == "training" else bytes_inf)(shapes))


def test_copy_bandwidth(benchmark):
    """This machine's copy bandwidth in the same run: the yardstick of the kernels' bandwidth."""
    src = torch.randn(16 << 20)  # 64 MiB
    dst = torch.empty_like(src)
    benchmark.group = "copy"
    benchmark.pedantic(lambda: dst.copy_(src), rounds=30, warmup_rounds=3, iterations=1)
    record(benchmark, "copy", "torch.copy_", 2 * src.numel() * 4)
