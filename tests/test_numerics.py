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
