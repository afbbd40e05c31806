"""The pack's ops: each CPU kernel vs Inductor's code, forward and forward+backward, at the example's shapes and at
large ones, with the bandwidth each kernel achieves next to this machine's copy bandwidth and, in training mode, the
peak memory of each (see conftest's summary).

Kernel and compiler are timed in one run, interleaved round by round in a shuffled order, each in its own compiled
region (one call per region, the kernel at its default config), as the autotuner times them; the kernel's numerics
are checked against float64 before it is timed.
Run: make bench   (or: pytest benchmarks/test_pack.py -k softmax)
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import nki_autotune.kernels  # noqa: F401
from nki_autotune.autotune.memory import peak_bytes
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.autotune.stats import median, ratio_of_medians
from nki_autotune.autotune.timing import Clock, Workload, interleave
from nki_autotune.registry import Key, TensorSpec, get_backend, get_op

from .conftest import COPY, RESULTS, Result

CPU = get_backend("cpu")
F32, I64 = 4, 8
ROUNDS = 15


def _key(op, mode, inputs, attrs=()):
    """inputs: (shape, dtype[, strides[, requires_grad]]) each."""
    specs = tuple(TensorSpec(tuple(i[0]), *i[1:]) for i in inputs)
    return Key.of(get_op(op), specs, dict(attrs), mode)


def _n(shape):
    return math.prod(shape)


def _hf(b, h, s, d):
    """Hugging Face's q/k: ``x.view(b, s, h, d).transpose(1, 2)``, needing a gradient."""
    return (b, h, s, d), "float32", (s * h * d, d, h * d, 1), True


CE_ATTRS = [("ignore_index", -100), ("reduction", "mean")]

# op, inputs, attrs, generator options, bytes (inference), bytes (training: forward + backward)
CASES = [
    ("rmsnorm", [(shape, "float32"), (shape[-1:], "float32")], [("eps", 1e-6)], {},
     lambda s: 2 * F32 * _n(s[0]), lambda s: 5 * F32 * _n(s[0]))
    for shape in ((8, 64), (512, 256), (4, 256, 256), (2048, 512), (8192, 1024))
] + [
    ("softmax", [((256, 128), "float32")], [("dim", -1)], {}, lambda s: 2 * F32 * _n(s[0]),
     lambda s: 5 * F32 * _n(s[0])),
    ("softmax", [((8, 4, 256, 256), "float32")], [("dim", -1)], {}, lambda s: 2 * F32 * _n(s[0]),
     lambda s: 5 * F32 * _n(s[0])),
    ("swiglu", [((64, 256), "float32")] * 2, [], {}, lambda s: 3 * F32 * _n(s[0]), lambda s: 8 * F32 * _n(s[0])),
    ("swiglu", [((4, 256, 512), "float32")] * 2, [], {}, lambda s: 3 * F32 * _n(s[0]),
     lambda s: 8 * F32 * _n(s[0])),
    ("swiglu", [((2048, 2048), "float32")] * 2, [], {}, lambda s: 3 * F32 * _n(s[0]), lambda s: 8 * F32 * _n(s[0])),
    ("rope", [_hf(4, 4, 256, 64), _hf(4, 2, 256, 64), ((1, 256, 64), "float32"), ((1, 256, 64), "float32")], [], {},
     lambda s: F32 * (2 * _n(s[0]) + 2 * _n(s[1]) + 2 * _n(s[2])),
     lambda s: F32 * (4 * _n(s[0]) + 4 * _n(s[1]) + 4 * _n(s[2]))),
    ("rope", [((8, 8, 512, 64), "float32")] * 2 + [((8, 512, 64), "float32")] * 2, [], {},
     lambda s: F32 * (4 * _n(s[0]) + 2 * _n(s[2])), lambda s: F32 * (10 * _n(s[0]) + 6 * _n(s[2]))),
    ("cross_entropy", [((64, 2048), "float32"), ((64,), "int64")], CE_ATTRS, {},
     lambda s: F32 * _n(s[0]), lambda s: 3 * F32 * _n(s[0])),
    ("cross_entropy", [((1024, 32000), "float32"), ((1024,), "int64")], CE_ATTRS, {},
     lambda s: F32 * _n(s[0]), lambda s: 3 * F32 * _n(s[0])),
    ("cross_entropy", [((2048, 32000), "float32"), ((2048,), "int64")], CE_ATTRS, {},
     lambda s: F32 * _n(s[0]), lambda s: 3 * F32 * _n(s[0])),
    ("cross_entropy", [((1024, 32000), "float32"), ((1024,), "int64")], [*CE_ATTRS, ("softcap", 30.0)], {},
     lambda s: F32 * _n(s[0]), lambda s: 3 * F32 * _n(s[0])),  # Gemma 2 and 3's capped logits
    ("embedding", [((4, 256), "int64"), ((32000, 256), "float32")], [("padding_idx", 0)], {"dist": "zipf"},
     lambda s: I64 * _n(s[0]) + 2 * F32 * _n(s[0]) * s[1][1],
     lambda s: I64 * _n(s[0]) + 3 * F32 * _n(s[0]) * s[1][1] + F32 * _n(s[1])),
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
    op, inputs, attrs, opts, _, _ = case
    shapes = "/".join("x".join(map(str, i[0])) + (" (HF view)" if len(i) > 2 and i[2] else "") for i in inputs)
    extra = "".join(f" {k}={v}" for k, v in [*(a for a in attrs if a[0] == "softcap"), *opts.items()])
    return f"{op} {shapes}{extra}"


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("case", CASES, ids=_label)
def test_op(case, mode):
    name, inputs, attrs, opts, bytes_inf, bytes_train = case
    op = get_op(name)
    impl = next(i for i in op.impls.values() if i.backend == "cpu")
    key = _key(name, mode, inputs, attrs)
    config = impl.default if impl.allows(impl.default, key) else impl.configs(key)[0]
    res = check_impl(impl, key, config, torch.Generator().manual_seed(0))
    assert res.ok, res  # verify as we measure
    w = Workload(op, key, CPU, sets=2, options=opts)
    w.prepare(1)
    compiler, kernel = w.compiler(), w.kernel(impl, config)
    times = interleave([compiler, kernel], rounds=ROUNDS, clock=Clock(CPU.synchronize), warmup=2)
    speedup, ci = ratio_of_medians(times["compiler"], times[kernel.name])
    peaks = (peak_bytes(lambda: compiler.step(0)), peak_bytes(lambda: kernel.step(0))) if key.grads else (None, None)
    shapes = [i[0] for i in inputs]
    RESULTS.append(Result(_label(case), mode, median(times["compiler"]), median(times[kernel.name]), speedup, ci,
                          (bytes_train if key.grads else bytes_inf)(shapes), *peaks))


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
