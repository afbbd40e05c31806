"""Attention: the CPU flash-attention kernel vs the compiler (Inductor's code for SDPA, which on the CPU calls
PyTorch's own flash attention, ``_scaled_dot_product_flash_attention_for_cpu``), forward+backward and forward,
with the peak memory of each (``autotune.memory.peak_bytes``: PyTorch's allocations and the kernel's pooled
outputs, the same method for both sides).

Shapes: the example's attention (examples/train.py: batch 4, 4 query heads over 2 k/v heads, 256 positions, head
dim 64, Hugging Face's transposed views and its boolean padding mask [4, 1, 256, 256]), and a larger causal one
(batch 1, 8 heads, 1024 positions, head dim 64, no mask). Timed as the autotuner times (interleaved rounds, each in
its own compiled region, the kernel at its default config and at one other tile size); the kernel's
numerics are checked against float64 first.
Run: pytest benchmarks/test_attention.py -q -s   (or make bench)
"""

from __future__ import annotations

import pytest
import torch

import nki_autotune.kernels  # noqa: F401
from nki_autotune.autotune.memory import peak_bytes
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.autotune.stats import median, ratio_of_medians
from nki_autotune.autotune.timing import Clock, Workload, interleave
from nki_autotune.registry import Key, TensorSpec, get_op

from .conftest import RESULTS, Result
from .test_pack import CPU, F32, ROUNDS, _hf, _n

IMPL = get_op("attention").impls["cpu_flash"]

CASES = {  # label: inputs, attrs, configs to time besides the default
    "example 4x4x256x64 (kv 2 heads, HF views, bool padding mask)": (
        [_hf(4, 4, 256, 64), _hf(4, 2, 256, 64), _hf(4, 2, 256, 64), ((4, 1, 256, 256), "bool")],
        [("causal", False), ("scale", 0.125)],
        [{"block_q": 128, "block_k": 256}]),
    "large 1x8x1024x64 causal": (
        [((1, 8, 1024, 64), "float32")] * 3 + [None], [("causal", True), ("scale", None)],
        [{"block_q": 256, "block_k": 256}]),
}


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize("label", CASES)
def test_attention(label, mode):
    inputs, attrs, others = CASES[label]
    specs = tuple(None if i is None else TensorSpec(tuple(i[0]), *i[1:]) for i in inputs)
    key = Key.of(IMPL.op, specs, dict(attrs), mode)
    configs = [dict(IMPL.default)] + [{**IMPL.default, **c} for c in others]
    for config in configs:
        res = check_impl(IMPL, key, config, torch.Generator().manual_seed(0))
        assert res.ok, (config, res)  # verify as we measure
    w = Workload(IMPL.op, key, CPU, sets=2)
    w.prepare(1)
    compiler = w.compiler()
    kernels = [w.kernel(IMPL, c) for c in configs]
    for i, kernel in enumerate(kernels):  # one name each: the times are kept by name
        kernel.name = f"{kernel.name}#{i}"
    times = interleave([compiler, *kernels], rounds=ROUNDS, clock=Clock(CPU.synchronize), warmup=2)
    q, k = inputs[0][0], inputs[1][0]
    nbytes = F32 * (2 * _n(q) + 2 * _n(k)) * (3 if key.grads else 1)  # q, k, v, out once (and their gradients)
    for config, kernel in zip(configs, kernels):
        speedup, ci = ratio_of_medians(times["compiler"], times[kernel.name])
        peaks = ((peak_bytes(lambda: compiler.step(0)), peak_bytes(lambda kernel=kernel: kernel.step(0)))
                 if key.grads else (None, None))
        tiles = f" q{config['block_q']}/k{config['block_k']}"
        RESULTS.append(Result(f"attention {label}{tiles}", mode, median(times["compiler"]),
                              median(times[kernel.name]), speedup, ci, nbytes, *peaks))
