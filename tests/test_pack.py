"""The pack's ops, every one ``nki_autotune.kernels`` finds: each against its PyTorch expression in float64,
forward and backward, kernels on and off, on calls each op draws fresh each run (``tests/calls.py``); opcheck;
graphs; then declines and edge cases of particular ops."""

from __future__ import annotations

import functools
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nki_autotune.kernels as nk
from nki_autotune.kernels.shared.indexed import BLOCKS, SERIAL, SORTED, scatter_add
from nki_autotune.kernels.shared.loss import OPTIONS
from nki_autotune.registry import explain, get_op

from .calls import PACK, fresh, grads_of, ids
from .helpers import as64, float32_floor, rel_err, run_with_grads
from .parallel import SEED

RNG = random.Random(SEED)
PLAIN = tuple(OPTIONS.values())  # the losses with every option off


FRESH = 3
"""Fresh draws per op and test: the first takes the examples' place where an op draws none."""


@pytest.mark.parametrize("switch", ["on", "off"])
@pytest.mark.parametrize("draw", range(FRESH), ids=lambda i: f"draw{i}")
@pytest.mark.parametrize("op", PACK, ids=ids())
def test_matches_float64_reference_forward_and_backward(switches, op, draw, switch):
    c = fresh(op, "float64", FRESH)[draw]
    switches(NKI_AUTOTUNE_KERNELS=switch)
    exp = explain(op.name, *grads_of(c), *c.attrs)
    assert exp.path == ("kernel" if switch == "on" else "compiler"), (c.label, exp)
    outs, grads = run_with_grads(c.kernel_or_compiler, c.tensors, wants=c.op.differentiable, names=op.tensors)
    ref_outs, ref_grads = run_with_grads(c.reference, as64(c.tensors), wants=c.op.differentiable, names=op.tensors)
    # the kernels hold 1e-5 on every input; PyTorch's float32 (the compiler path) only where the input lets it,
    # and so an op that waives it (docs/adding-an-op.md), held to the same floor
    floor = switch == "off" or "float64 within 1e-5" in op.waives
    tol = max(1e-5, 4 * float32_floor(c.reference, c.tensors, wants=op.differentiable, names=op.tensors)) \
        if floor else 1e-5
    for o, r in zip(outs, ref_outs):
        if not r.is_floating_point():  # predicted classes
            assert torch.equal(o, r), c.label
            continue
        assert o.shape == r.shape and o.dtype == torch.float32, c.label
        assert rel_err(o, r) < tol, c.label
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape, c.label
        assert rel_err(g, r) < tol, c.label


@pytest.mark.parametrize("op", PACK, ids=ids())
def test_bfloat16_in_and_out_within_1e_2_of_float64(switches, op):
    """bfloat16 inputs, outputs and gradients, computed in float32 by the kernel."""
    c = fresh(op, "bfloat16", 1, dtype="bfloat16")[0]
    switches(NKI_AUTOTUNE_KERNELS="on")
    assert explain(op.name, *grads_of(c), *c.attrs).path == "kernel", c.label
    kw = {"wants": op.differentiable, "names": op.tensors}
    outs, grads = run_with_grads(c.kernel_or_compiler, c.tensors, **kw)
    ref_outs, ref_grads = run_with_grads(c.reference, as64(c.tensors), grad_dtype=torch.bfloat16, **kw)
    tol = 1e-2
    if "bfloat16 within 1e-2" in op.waives:  # products in bfloat16: held to twice the expression's own bfloat16 error
        exp_outs, exp_grads = run_with_grads(c.reference, c.tensors, **kw)
        tol = max(tol, 2 * max(rel_err(o, r) for o, r in zip((*exp_outs, *exp_grads), (*ref_outs, *ref_grads))))
    for o, r in zip(outs, ref_outs):
        if r.is_floating_point():  # (predicted classes of bfloat16 logits: ties the float64 reference breaks)
            assert o.dtype == torch.bfloat16 and rel_err(o, r) < tol, c.label
    floats = [t for t, n in zip(c.tensors, op.tensors) if t is not None and t.is_floating_point()
              and n in op.differentiable]
    for g, r, t in zip(grads, ref_grads, floats):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape and rel_err(g, r) < tol, c.label


def test_bfloat16_rope_cos_gradient_summed_over_heads_is_within_1e_2(switches):
    """cos and sin's gradients sum over heads and batch, where a bfloat16 output gradient's rounding, amplified by
    cancellation, alone reaches 3e-2 of the exact one at one position of width 2 (11 seeds in 300): the bar is
    the float64 reference given that same rounded gradient, which the kernel's float32 sums hold."""
    ref = get_op("rope").reference
    switches(NKI_AUTOTUNE_KERNELS="on")
    for seed in range(100):
        gen = torch.Generator().manual_seed(seed)
        q, k = torch.randn(1, 4, 1, 2, generator=gen), torch.randn(1, 4, 1, 2, generator=gen)
        ang = torch.rand(1, 1, 1, generator=gen) * 6
        inputs = tuple(t.bfloat16() for t in (q, k, torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()))
        assert explain("rope", *(t.detach().requires_grad_() for t in inputs)).path == "kernel"
        _, grads = run_with_grads(nk.rope, inputs)
        _, ref_grads = run_with_grads(ref, as64(inputs), grad_dtype=torch.bfloat16)
        for g, r in zip(grads, ref_grads):
            assert g.dtype == torch.bfloat16 and rel_err(g, r) < 1e-2, seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cos_batch", [1, 3])
def test_rope_reads_hugging_face_transposed_views_in_place(switches, dtype, cos_batch):
    """q, k as Hugging Face makes them (``x.view(b, s, h, d).transpose(1, 2)``), cos/sin of batch 1 (no
    position_ids) or of the batch: the kernel takes them, reads their memory without a copy, and is right."""
    from nki_autotune.kernels.rope import cpu as rope_cpu

    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    b, s, hq, hk, d = 3, 7, 4, 2, 16
    q = torch.randn(b, s, hq * d, generator=gen).to(dtype).view(b, s, hq, d).transpose(1, 2)
    k = torch.randn(b, s, hk * d, generator=gen).to(dtype).view(b, s, hk, d).transpose(1, 2)
    ang = torch.rand(cos_batch, s, d // 2, generator=gen) * 50
    cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
    assert not q.is_contiguous() and q.stride() == (s * hq * d, d, hq * d, 1)
    view, bshd = rope_cpu._heads(q)
    assert bshd and view.flags.c_contiguous and view.ctypes.data == q.data_ptr()  # the same memory, read in place
    switches(NKI_AUTOTUNE_KERNELS="on")
    assert explain("rope", q, k, cos, sin).path == "kernel"
    ref = get_op("rope").reference
    outs, grads = run_with_grads(nk.rope, (q, k, cos, sin))
    ref_outs, ref_grads = run_with_grads(ref, as64((q, k, cos, sin)), grad_dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert all(o.dtype == dtype and rel_err(o, r) < tol for o, r in zip(outs, ref_outs))
    assert all(g.shape == r.shape and rel_err(g, r) < tol for g, r in zip(grads, ref_grads))


def test_rmsnorm_with_eps_0_gives_nan_on_a_zero_row_like_pytorch(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    x = torch.randn(3, 8)
    x[1] = 0
    w = torch.randn(8)
    outs, grads = run_with_grads(lambda a, b: nk.rmsnorm(a, b, 0.0), (x, w))
    ref_outs, ref_grads = run_with_grads(lambda a, b: get_op("rmsnorm").reference(a, b, 0.0), (x, w))
    for got, ref in zip(outs + grads, ref_outs + ref_grads):
        assert torch.equal(got.isnan(), ref.isnan()) and got.isnan().any()
        torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", PACK, ids=ids())
def test_opcheck(op):
    c = fresh(op, "opcheck", 1)[0]
    for impl in op.impls.values():
        if impl.backend != "cpu":
            continue
        torch.library.opcheck(impl.fwd_op, (*grads_of(c), *c.attrs, *impl.call_args(impl.configs()[-1], c.key)))


@pytest.mark.parametrize("name, args, why", [
    ("softmax", lambda: (torch.randn(4, 6, dtype=torch.float64), 1), "dtype float64"),
    ("softmax", lambda: (torch.randn(4, 6), 0), "dim=0"),
    ("softmax", lambda: (torch.randn(6, 4).t(), -1), "rows are not contiguous"),
    ("swiglu", lambda: (torch.randn(4, 6), torch.randn(1, 6)), "no broadcasting"),
    ("geglu", lambda: (torch.randn(4, 6), torch.randn(1, 6)), "no broadcasting"),
    ("rope", lambda: (torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 5), torch.randn(1, 3, 5), torch.randn(1, 3, 5)),
     "odd head dim"),
    ("rope", lambda: (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4)),
     "no broadcasting but cos/sin of batch 1"),
    ("rope", lambda: (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4),
                      torch.randn(1, 3, 4).bfloat16()), "mixed float dtypes"),
    ("cross_entropy", lambda: (torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), None, -100),
     "supports logits"),
    ("cross_entropy", lambda: (torch.randn(3, 4), torch.zeros(3, dtype=torch.long), torch.rand(5), -100),
     "weight [V]"),
    ("segment_sum", lambda: (torch.randn(3, 2).double(), torch.zeros(3, dtype=torch.long), 2), "dtype float64"),
    ("segment_sum", lambda: (torch.randn(3, 2), torch.zeros(3, dtype=torch.long), -1), "must not be negative"),
    ("cross_entropy", lambda: (torch.randn(3, 4), torch.zeros(3, dtype=torch.int32), None, -100), "dtype int32"),
    ("rmsnorm", lambda: (torch.randn(129, 1, requires_grad=True), torch.randn(1), 1e-6), "rows of one element"),
])
def test_declines_take_the_compiler_path(switches, name, args, why):
    switches(NKI_AUTOTUNE_KERNELS="on")
    a = args()
    exp = explain(name, *a)
    assert exp.path == "compiler" and why in exp.reason, exp.reason
    fn = getattr(nk, name)
    try:
        expect = _first(_reference(name, *a))
    except (RuntimeError, ValueError) as e:  # what PyTorch rejects is rejected alike
        with pytest.raises(type(e)):
            fn(*a)
        return
    torch.testing.assert_close(_first(fn(*a)), expect)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _reference(name, *args):
    """The op's reference on positional arguments, the attributes not given at their defaults."""
    op = get_op(name)
    given = len(args) - len(op.tensors)
    return op.reference(*args, *(op.defaults[a] for a in list(op.attrs)[given:]))


@pytest.mark.parametrize("pad", [4, -5])
def test_embedding_padding_idx_out_of_range_is_rejected_as_pytorch_does(switches, pad):
    switches(NKI_AUTOTUNE_KERNELS="on")
    ids, w = torch.zeros(3, dtype=torch.long), torch.randn(4, 2)
    exp = explain("embedding", ids, w, pad)
    assert exp.path == "compiler" and f"padding_idx={pad} outside" in exp.reason
    with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
        nk.embedding(ids, w, pad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_reductions_with_every_target_ignored_match_pytorch(switches, reduction):
    """The mean of no targets is 0/0 = nan in PyTorch (and so its gradient); their sum is 0."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    logits = torch.randn(4, 7, requires_grad=True)
    target = torch.full((4,), -100)
    assert explain("cross_entropy", logits, target, None, -100, reduction).path == "kernel"
    got = nk.cross_entropy(logits, target, reduction=reduction)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, reduction=reduction)
    torch.testing.assert_close(got, ref, equal_nan=True)
    got.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, equal_nan=True)


def test_embedding_gradient_is_zero_at_the_padding_row_and_summed_elsewhere(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    w = torch.randn(6, 3, requires_grad=True)
    ids = torch.tensor([[5, 1, 5], [1, 0, 2]])
    assert explain("embedding", ids, w, -1).path == "kernel"
    out = nk.embedding(ids, w, padding_idx=-1)
    torch.testing.assert_close(out, w.detach()[ids])
    dy = torch.randn(2, 3, 3)
    out.backward(dy)
    expect = torch.zeros(6, 3)
    expect[1] = dy[0, 1] + dy[1, 0]
    expect[0], expect[2] = dy[1, 1], dy[1, 2]
    torch.testing.assert_close(w.grad, expect)


def _call_impl(impl, attrs, cfg, *tensors):
    return _first(impl.fwd_op(*tensors, *attrs, *cfg))


def _peaked(rows: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with one column per row about 15 above the rest: probability within 1e-6 of 1 there."""
    x = torch.randn(rows, width, generator=gen) * 0.5
    peak = torch.randint(0, width, (rows,), generator=gen)
    x[torch.arange(rows), peak] += 15
    return x, peak


@pytest.mark.parametrize("name", ["softmax", "cross_entropy"])
def test_peaked_rows_stay_exact_where_float32_pytorch_cancels(monkeypatch, gen, name):
    """dsoftmax at the peak is y_peak * (dy_peak - sum(y * dy)), and the loss at a confident target
    lse - x_t: both cancel in float32 as PyTorch writes them. Every impl, every CPU config, holds 1e-5."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    x, peak = _peaked(3, 6, gen)
    op = get_op(name)
    inputs, attrs = ((x,), (-1,)) if name == "softmax" else ((x, peak, None), (-100, "mean", None, *PLAIN))
    ref = lambda *t: op.reference(*t, *attrs)  # noqa: E731
    assert float32_floor(ref, inputs) > 1e-5  # the case is a hard one for float32
    ref_outs, ref_grads = run_with_grads(ref, as64(inputs))
    for impl in op.impls.values():
        configs = impl.configs() if impl.backend == "cpu" else [impl.default]
        for cfg in configs:
            call = functools.partial(_call_impl, impl, attrs, impl.config_values(cfg))
            outs, grads = run_with_grads(call, inputs)
            errs = [rel_err(outs[0], ref_outs[0])] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
            assert max(errs) < 1e-5, (impl.qualname, cfg, errs)


def test_cross_entropy_far_below_zero_with_ignored_rows(monkeypatch, gen):
    """Logits near -200 (exp(-max) overflows float32) beside ignored rows: every impl finite and right."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    x = torch.randn(6, 9, generator=gen) - 200
    t = torch.randint(0, 9, (6,), generator=gen)
    t[1::2] = -100
    ref = functools.partial(F.cross_entropy, ignore_index=-100)
    ref_outs, ref_grads = run_with_grads(ref, as64((x, t)))
    attrs = (-100, "mean", None, *PLAIN)
    for impl in get_op("cross_entropy").impls.values():
        call = functools.partial(_call_impl, impl, attrs, impl.config_values(None))
        outs, grads = run_with_grads(call, (x, t, None))
        assert rel_err(outs[0], ref_outs[0]) < 1e-5 and rel_err(grads[0], ref_grads[0]) < 1e-5, impl.qualname


def test_segment_sum_empty_segments_and_repeated_indices(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    src = torch.randn(6, 3)
    index = torch.tensor([4, 4, 4, 0, 4, 0])
    out = nk.segment_sum(src, index, 7)
    expect = torch.zeros(7, 3)
    expect[0] = src[3] + src[5]
    expect[4] = src[0] + src[1] + src[2] + src[4]
    torch.testing.assert_close(out, expect)
    for impl_cfg in get_op("segment_sum").impls["cpu_scatter"].configs():  # every scatter strategy
        cfg = tuple(impl_cfg.values())
        torch.testing.assert_close(get_op("segment_sum").impls["cpu_scatter"].fwd_op(src, index, 7, *cfg), expect)


@pytest.mark.parametrize("mode", [SERIAL, BLOCKS, SORTED])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_scatter_into_no_rows_writes_nothing(mode, threads):
    """A segment sum into no segments checks no index (as index_add_), so the scatter gets indices past its empty
    output. numba types an empty array as C-contiguous and places ``out[i, j]`` by the shape, not the strides: rows
    0..3 of an empty [0, 5] output were written after its memory (here the buffer it views; in a segment sum, past
    a heap block of 24 bytes, and glibc aborted a later allocation of the process)."""
    buf = np.full((4, 5), 7.0, np.float32)
    scatter_add(np.ones((4, 5), np.float32), np.array([0, 1, 1, 3]), buf[:0], mode, threads)
    assert (buf == 7.0).all()


@pytest.mark.parametrize("name, call, error, message", [
    ("embedding", lambda f: f(torch.tensor([0, 9]), torch.randn(5, 2)), IndexError, "index out of range in self"),
    ("embedding", lambda f: f(torch.tensor([-1]), torch.randn(5, 2)), IndexError, "index out of range in self"),
    ("segment_sum", lambda f: f(torch.randn(2, 2), torch.tensor([0, 5]), 3), RuntimeError,
     "index 5 is out of bounds for dimension 0 with size 3"),
    ("cross_entropy", lambda f: f(torch.randn(2, 3), torch.tensor([0, 7])), IndexError, "Target 7 is out of bounds"),
])
@pytest.mark.parametrize("switch", ["on", "off"])
def test_out_of_range_indices_raise_what_pytorch_raises(switches, name, call, error, message, switch):
    switches(NKI_AUTOTUNE_KERNELS=switch)
    with pytest.raises(error, match=message):
        call(getattr(nk, name))


@pytest.mark.parametrize("segments, width, index, message", [
    (0, 5, [0, 1, 1, 3], "self indexing axis dim should be positive"),
    (0, 0, [2, 0], "self indexing axis dim should be positive"),
    (4, 0, [0, 9], "INDICES element is out of DATA bounds, id=9 axis_dim=4"),
])
@pytest.mark.parametrize("switch", ["on", "off"])
def test_a_segment_sum_into_nothing_checks_its_indices_in_the_backward(switches, segments, width, index, message,
                                                                        switch):
    """index_add_ into an empty result checks no index, so the forward passes; the backward gathers rows of the
    gradient by those indices, and must raise what index_select raises rather than read past the gradient."""
    switches(NKI_AUTOTUNE_KERNELS=switch)
    src = torch.randn(len(index), width, requires_grad=True)
    out = nk.segment_sum(src, torch.tensor(index), segments)
    assert out.shape == (segments, width)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        out.sum().backward()


@pytest.mark.parametrize("op", PACK, ids=ids())
def test_under_torch_compile_the_kernel_is_in_the_graph_without_breaks(switches, op):
    from torch._dynamo.utils import counters

    c = fresh(op, "compile", 1)[0]
    impl = next(i for i in op.impls.values() if i.backend == "cpu")
    for switch, present in (("on", True), ("off", False)):
        torch._dynamo.reset()
        counters.clear()
        switches(NKI_AUTOTUNE_KERNELS=switch)
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(c.kernel_or_compiler, backend=backend, fullgraph=True, dynamic=False)
        for _ in range(3):
            out = compiled(*c.tensors)
        assert len(graphs) == 1 and counters["graph_break"] == {}, c.label
        targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
        assert (str(impl.fwd_op) in targets) == present, c.label
        torch.testing.assert_close(_first(out), _first(c.reference(*c.tensors)), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("call", [
    lambda: nk.softmax(torch.randn(3, 4), dim=1.5),
    lambda: nk.segment_sum(torch.randn(3, 4), torch.tensor([0, 1, 1]), 2.0),
    lambda: nk.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2]), ignore_index=1.0),
    lambda: nk.embedding(torch.tensor([0, 1]), torch.randn(3, 4), padding_idx=0.5),
], ids=["softmax dim", "segment_sum num_segments", "cross_entropy ignore_index", "embedding padding_idx"])
def test_a_float_where_pytorch_takes_an_integer_is_refused_as_pytorch_refuses_it(call):
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        call()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_output_computed_from_no_input_needing_a_gradient_carries_none(switches, compiled):
    """rope with only q needing a gradient (a frozen key projection): its k output carries no gradient, as the
    expression's does, so autograd neither keeps a graph for it nor lets a backward from it pass silently."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 8, 16, generator=gen), torch.randn(2, 2, 8, 16, generator=gen)
    cos, sin = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    assert explain("rope", q.requires_grad_(), k, cos, sin).path == "kernel"
    fn = torch.compile(nk.rope, fullgraph=True, dynamic=False) if compiled else nk.rope
    qo, ko = fn(q, k, cos, sin)
    ref_q, ref_k = get_op("rope").reference(q, k, cos, sin)
    assert (qo.requires_grad, ko.requires_grad) == (ref_q.requires_grad, ref_k.requires_grad) == (True, False)
    seed = torch.randn(qo.shape, generator=gen)
    (got,) = torch.autograd.grad(qo, q, seed)
    (want,) = torch.autograd.grad(ref_q, q, seed)
    assert rel_err(got, want) < 1e-6
    with pytest.raises(RuntimeError, match="does not require grad"):
        ko.sum().backward()


def test_geglu_saturates_where_pytorch_does(switches):
    """gelu's ``1 + tanh`` rounds to 0 for gates below about -5.3 in float32: there PyTorch's gelu is -0 and its
    derivative 0, so an infinite ``up`` or output gradient gives nan; the kernel's tanh rounds where PyTorch's does.
    (Between -5.4 and -5.0 PyTorch's own result depends on where the element sits: its vectorised tanh rounds to -1
    from about -5.15 up, its scalar tanh for a tensor's last elements from -5.16 down, as the kernel's.)"""
    switches(NKI_AUTOTUNE_KERNEL_GEGLU="on")
    g = torch.cat([torch.linspace(-12, -5.4, 6601), torch.linspace(-5, 12, 17001)]).requires_grad_()
    up = torch.full_like(g, float("inf")).requires_grad_()
    nans = []
    for fn in (nk.geglu, lambda a, b: F.gelu(a, approximate="tanh") * b):
        y = fn(g, up)
        dg, du = torch.autograd.grad(y, (g, up), torch.full_like(y, float("inf")))
        nans.append(torch.stack([y.isnan(), dg.isnan(), du.isnan()]))
    assert torch.equal(nans[0], nans[1])
    assert 0 < nans[0][0].sum() < g.numel()
