"""Every NKI impl of the pack through the interpreter, on trn2 and trn3: forward and backward against the
float64 reference on each op's examples and on fresh shapes, every admitted config within the limits."""

from __future__ import annotations

import random

import pytest
import torch

from nki_autotune.autotune.numerics import check_impl
from nki_autotune.registry import Key, ops

from .helpers import key_of

NKI_IMPLS = [impl for op in ops().values() for impl in op.impls.values() if impl.backend == "neuron"]
SEED = random.SystemRandom().randrange(2**31)


@pytest.fixture(params=["trn2", "trn3"])
def target(request, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", request.param)
    return request.param


def _keys(impl):
    op = impl.op
    for inputs, extra in op.examples:
        for mode in ("inference", "training"):
            yield key_of(op.name, mode, inputs, {**op.defaults, **extra})


def test_every_op_has_an_nki_impl():
    assert {i.op.name for i in NKI_IMPLS} == set(ops())


@pytest.mark.parametrize("impl", NKI_IMPLS, ids=lambda i: i.qualname)
def test_examples_forward_and_backward(target, impl):
    for key in _keys(impl):
        if impl.supports(key.inputs, key.attr_dict):
            continue
        for cfg in impl.configs(key):  # every config the constraint admits runs and is right
            res = check_impl(impl, key, cfg, torch.Generator().manual_seed(SEED))
            assert res.ok, (key.label(), cfg, res)


def _fresh_key(name: str, rng: random.Random, dtype: str) -> Key:
    n, d = rng.randint(1, 200), rng.randint(1, 150)
    shapes = {
        "rmsnorm": ([((n, d), dtype), ((d,), dtype)], {"eps": 1e-6}),
        "softmax": ([((n, d), dtype)], {"dim": -1}),
        "swiglu": ([((n, d), dtype), ((n, d), dtype)], {}),
        "rope": ([((2, 3, n, 2 * d), dtype), ((2, 1, n, 2 * d), dtype), ((2, n, 2 * d), dtype),
                  ((2, n, 2 * d), dtype)], {}),
        "cross_entropy": ([((n, d + 1), dtype), ((n,), "int64")], {"ignore_index": -100}),
        "embedding": ([((n,), "int64"), ((d + 1, 16), dtype)], {}),
        "segment_sum": ([((n, 5), dtype), ((n,), "int64")], {"num_segments": d + 1}),
    }[name]
    return key_of(name, "training", shapes[0], shapes[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", NKI_IMPLS, ids=lambda i: f"{i.qualname}-seed{SEED}")
def test_fresh_shapes(impl, dtype):
    rng = random.Random(SEED + hash(impl.qualname) % 1000)
    key = _fresh_key(impl.op.name, rng, dtype)
    why = impl.supports(key.inputs, key.attr_dict)
    assert why is None, why  # every NKI impl takes float32 and bfloat16 at these sizes
    cfg = dict(impl.default) if impl.allows(impl.default, key) else impl.configs(key)[0]
    res = check_impl(impl, key, cfg, torch.Generator().manual_seed(SEED))
    assert res.ok, (key.label(), cfg, res)


def test_nki_embedding_and_segment_sum_sum_repeated_indices_and_reject_out_of_range():
    emb = ops()["embedding"].impls["nki_gather"]
    ids = torch.tensor([[3, 3, 3], [0, 3, 1]])
    w = torch.randn(5, 4, requires_grad=True)
    out = emb.fwd_op(ids, w, None, 128, 512)
    torch.testing.assert_close(out, torch.nn.functional.embedding(ids, w.detach()))
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.tensor([1.0, 1, 0, 4, 0]).unsqueeze(1).expand(5, 4))
    with pytest.raises(IndexError, match="index out of range in self"):
        emb.fwd_op(torch.tensor([5]), w.detach(), None, 128, 512)
    seg = ops()["segment_sum"].impls["nki_matmul"]
    with pytest.raises(RuntimeError, match="index 9 is out of bounds for dimension 0 with size 4"):
        seg.fwd_op(torch.randn(2, 3), torch.tensor([0, 9]), 4, 128, 512)
