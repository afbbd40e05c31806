"""Every NKI impl of the pack through the simulation (the real ``nki.simulate`` where nki 0.7 is installed, else the
interpreter), on trn2 at LNC=1 and trn3 at LNC=2 (each program of the launch takes its share of the work): forward
and backward against the float64 reference on each op's examples and on fresh shapes, every admitted config within
the limits, and indices outside their table rejected by the kernels' own bounds checks."""

from __future__ import annotations

import random

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.autotune.numerics import check_impl, compare
from nki_autotune.registry import Key, TensorSpec, ops
from nki_autotune.registry.neuron.interp import NkiError
from nki_autotune.registry.neuron.nki import REAL

from .helpers import key_of
from .parallel import SEED

NKI_IMPLS = [impl for op in ops().values() for impl in op.impls.values() if impl.backend == "neuron"]


@pytest.fixture(params=[("trn2", "1"), ("trn3", "2")], ids=lambda p: f"{p[0]}-lnc{p[1]}")
def target(request, monkeypatch):
    name, lnc = request.param
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    return name


def _keys(impl):
    op = impl.op
    for inputs, extra in op.examples:
        for mode in ("inference", "training"):
            yield key_of(op.name, mode, inputs, {**op.defaults, **extra})


def test_every_op_of_the_pack_has_an_nki_impl():
    assert {i.op.name for i in NKI_IMPLS} >= set(nk.OPS) and len(nk.OPS) >= 10  # tests register ops of their own


@pytest.mark.parametrize("impl", NKI_IMPLS, ids=lambda i: i.qualname)
def test_examples_forward_and_backward(target, impl):
    for key in _keys(impl):
        if impl.supports(key.inputs, key.attr_dict):
            continue
        for cfg in impl.configs(key):  # every config the constraint admits runs and is right
            res = check_impl(impl, key, cfg, torch.Generator().manual_seed(SEED))
            assert res.ok, (key.label(), cfg, res)


def _fresh_key(op, rng: random.Random, dtype: str) -> Key:
    """A call the op draws (docs/adding-an-op.md), in training."""
    inputs, extra = op.draw(rng, dtype)
    return key_of(op.name, "training", inputs, {**op.defaults, **extra})


@pytest.mark.parametrize("dtype, lnc", [("float32", "1"), ("bfloat16", "2")])
@pytest.mark.parametrize("impl", NKI_IMPLS, ids=lambda i: f"{i.qualname}-seed{SEED}")
def test_fresh_shapes(impl, dtype, lnc, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    rng = random.Random(f"{SEED} {impl.qualname}")  # the same in every process, unlike hash()
    whys = []
    for _ in range(50):  # the op's draws, until one this impl takes (some take one reduction, no padding row)
        key = _fresh_key(impl.op, rng, dtype)
        why = impl.supports(key.inputs, key.attr_dict)
        if why is None:
            break
        whys.append(why)
    assert why is None, sorted(set(whys))
    cfg = dict(impl.default) if impl.allows(impl.default, key) else impl.configs(key)[0]
    res = check_impl(impl, key, cfg, torch.Generator().manual_seed(SEED))
    bar = res.tolerance
    if dtype == "bfloat16" and "bfloat16 within 1e-2" in impl.op.waives:  # twice the expression's own error
        attrs = tuple(key.attr_dict[a] for a in impl.op.attrs)
        def expression(*ts):
            out = impl.op.reference(*ts, *attrs)
            return out if isinstance(out, tuple) else (out,)

        own = compare(impl.op, key, expression, torch.Generator().manual_seed(SEED))
        bar = max(bar, 2 * own.rel_err)
    assert res.rel_err <= bar, (key.label(), cfg, res, bar)


OOB = pytest.mark.skipif(REAL, reason="the interpreter's error type; the real simulator raises its own")


@OOB
def test_nki_embedding_and_segment_sum_sum_repeated_indices_and_reject_out_of_range():
    emb = ops()["embedding"].impls["nki_gather"]
    ids = torch.tensor([[3, 3, 3], [0, 3, 1]])
    w = torch.randn(5, 4, requires_grad=True)
    out = emb.fwd_op(ids, w, None, 128, 512)
    torch.testing.assert_close(out, torch.nn.functional.embedding(ids, w.detach()))
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.tensor([1.0, 1, 0, 4, 0]).unsqueeze(1).expand(5, 4))
    for bad in (5, -1, 2**40):  # past the end, negative, and beyond int32 (saturated, not wrapped into range)
        with pytest.raises(NkiError, match="outside .*oob_mode=error"):
            emb.fwd_op(torch.tensor([1, bad]), w.detach(), None, 128, 512)
    seg = ops()["segment_sum"].impls["nki_matmul"]
    torch.testing.assert_close(seg.fwd_op(torch.ones(3, 2), torch.tensor([0, 3, 3]), 4, 128, 512),
                               torch.tensor([[1.0, 1], [0, 0], [0, 0], [2, 2]]))
    with pytest.raises(NkiError, match="outside .*oob_mode=error"):
        seg.fwd_op(torch.randn(2, 3), torch.tensor([0, 9]), 4, 128, 512)


@OOB
def test_nki_cross_entropy_checks_targets_in_the_kernel_and_skips_ignored_rows():
    ce = ops()["cross_entropy"].impls["nki_online"]
    x = torch.randn(3, 700)  # one full chunk of 512 in the compiled loop, a tail of 188
    target = torch.tensor([5, -100, 699])
    loss = ce.fwd_op(x, target, None, -100, "mean", None, 0.0, 0.0, False, 128, 512)[0]
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(x, target))
    for bad in (700, -3):
        with pytest.raises(NkiError, match="outside .*oob_mode=error"):
            ce.fwd_op(x, torch.tensor([5, bad, 0]), None, -100, "mean", None, 0.0, 0.0, False, 128, 512)


GATED_LAYOUTS = {  # gate's and up's strides at shape [3, 40, 48] (None: contiguous)
    "fused-halves": ((40 * 96, 96, 1), (40 * 96, 96, 1)),  # Phi-3's gate_up_proj(x).chunk(2, dim=-1)
    "one-half": (None, (40 * 96, 96, 1)),
    "transposed": ((48, 3 * 48, 1), None),  # leading dims that no single stride spans
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", GATED_LAYOUTS)
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_ops_read_gate_and_up_in_place_in_any_row_layout(target, name, layout, dtype):
    """gate and up in the layouts models pass (rows strided, or leading dims that do not collapse) are read through
    access patterns, no copy; forward and backward against float64, tiles of 32 rows (40 per group: a short one)."""
    impl = ops()[name].impls["nki_tiled"]
    specs = tuple(TensorSpec((3, 40, 48), dtype, strides, requires_grad=True) for strides in GATED_LAYOUTS[layout])
    assert impl.supports(specs, {}) is None
    key = Key.of(impl.op, specs, {}, "training")
    for cfg in (dict(impl.default), {"rows_per_tile": 32, "cols": 512}):
        res = check_impl(impl, key, cfg, torch.Generator().manual_seed(SEED))
        assert res.ok, (layout, cfg, res)
