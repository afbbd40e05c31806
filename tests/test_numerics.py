"""The numerics gate and the statistics the decisions rest on."""

from __future__ import annotations

import numpy as np
import torch

from nki_autotune.autotune.numerics import Numerics, compare, poisoned, tolerance
from nki_autotune.autotune.stats import bootstrap_ci, paired_difference, ratio_of_medians
from nki_autotune.registry import get_op

from .helpers import key_of

OP = get_op("rmsnorm")


def key(dtype="float32", mode="training", shape=(16, 32)):
    return key_of("rmsnorm", mode, [(shape, dtype), (shape[-1:], dtype)], {"eps": 1e-6})


def test_tolerance_by_dtype():
    assert tolerance(key("float32")) == 1e-5
    assert tolerance(key("bfloat16")) == 1e-2
    assert tolerance(key("float16")) == 1e-3


def test_poisoned_allocations_are_nan():
    with poisoned():
        assert torch.isnan(torch.empty(64)).all()
        assert (torch.empty(4, dtype=torch.int64) == torch.iinfo(torch.int64).max).all()
    assert not torch.are_deterministic_algorithms_enabled()


def test_reference_passes_and_wrong_gradients_fail():
    gen = torch.Generator().manual_seed(1)
    ok = compare(OP, key(), lambda x, w: (OP.reference(x, w, 1e-6),), gen)
    assert ok.ok and ok.rel_err < 1e-6

    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    bad = compare(OP, key(), lambda x, w: (OP.reference(BadGrad.apply(x), w, 1e-6),), gen)
    assert not bad.ok and "grad x" in bad.detail
    # inference compares outputs only, so the same function passes
    assert compare(OP, key(mode="inference"), lambda x, w: (OP.reference(BadGrad.apply(x), w, 1e-6),), gen).ok


def test_a_gradient_that_cancels_exactly_is_compared_absolutely():
    """Over a single key the softmax is 1 and the gradients of q and k vanish: the float64 reference holds its
    rounding (about 1e-16), the candidate its own (1e-8 in float32). Relative to the first, the second was an
    error of 1e8; a gradient of the size of the inputs there still fails."""
    att = get_op("attention")
    k = key_of("attention", "training", [((1, 1, 1, 8), "float32")] * 3 + [None],
               {"causal": False, "scale": None})

    def in_float32(q, kk, v, mask):
        return (att.reference(q, kk, v, mask, False, None),)

    for seed in range(8):
        res = compare(att, k, in_float32, torch.Generator().manual_seed(seed))
        assert res.ok and res.rel_err < 1e-6, (seed, res)

    class Leak(torch.autograd.Function):  # 1e-3 more in each element of q's gradient
        @staticmethod
        def forward(ctx, q):
            return q.clone()

        @staticmethod
        def backward(ctx, g):
            return g + 1e-3

    bad = compare(att, k, lambda q, kk, v, m: (att.reference(Leak.apply(q), kk, v, m, False, None),),
                  torch.Generator().manual_seed(0))
    assert not bad.ok and bad.detail == "worst: grad q", bad


def test_nan_and_inf_never_pass():
    assert not Numerics(float("nan"), 1e-5).ok
    gen = torch.Generator().manual_seed(2)
    res = compare(OP, key(mode="inference"), lambda x, w: (torch.full_like(x, float("inf")),), gen)
    assert not res.ok


def test_bootstrap_interval_brackets_the_median():
    rng = np.random.default_rng(0)
    xs = rng.normal(2.0, 0.1, 200)
    lo, hi = bootstrap_ci(xs)
    assert lo < np.median(xs) < hi and hi - lo < 0.1
    s, (lo, hi) = ratio_of_medians([2.0] * 30, [1.0] * 30)
    assert s == 2.0 and lo == hi == 2.0
    c, k = rng.normal(2.0, 0.2, 60), rng.normal(1.0, 0.1, 60)
    s, (lo, hi) = ratio_of_medians(c, k)
    assert s == np.median(c) / np.median(k) and lo < s < hi and 1.7 < lo and hi < 2.3
    d, (lo, hi) = paired_difference(c, k)
    assert lo < d < hi and abs(d - 1.0) < 0.15
