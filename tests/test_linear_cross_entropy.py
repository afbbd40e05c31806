"""nk.linear_cross_entropy: the loss and the gradients of hidden, weight and bias against the expression in float64,
on the CPU kernel (over several token chunks) and the NKI kernel (through the interpreter); compiled, one graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import nki_autotune.kernels as nk
from nki_autotune.kernels.linear_cross_entropy.cpu import BLOCK_BYTES, ONEDNN, block_rows
from nki_autotune.kernels.linear_cross_entropy.op import reference
from nki_autotune.kernels.shared.loss import OPTIONS
from nki_autotune.registry import get_op

from .helpers import rel_err
from .test_compile import Graphs, targets

OP = get_op("linear_cross_entropy")
CPU = OP.impls["cpu_chunks"]
NKI = OP.impls["nki_tiled"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
PLAIN = tuple(OPTIONS.values())  # every option off
PRODUCTS = [pytest.param(0, id="blas"),
            pytest.param(1, id="onednn", marks=pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN"))]


def inputs(gen, n=150, h=24, v=70, bias=False, dtype=torch.float32, ignored=(3, 77)):
    """hidden [n, h], weight [v, h], targets with the rows ``ignored`` set to -100, bias [v] or None."""
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h ** 0.5).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    target[[i for i in ignored if i < n]] = -100
    b = (0.3 * torch.randn(v, generator=gen)).to(dtype) if bias else None
    return hidden, weight, target, b


def grads(fn, hidden, weight, target, bias, seed=2.5):
    """The loss and the gradients of ``seed * loss`` for hidden, weight and bias (None where bias is)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    loss = fn(leaves[0], leaves[1], target, leaves[2] if bias is not None else None)
    got = torch.autograd.grad(loss * seed, leaves)
    return loss.detach(), got


def kernel(impl=CPU, chunk=64, threads=2, ignore_index=-100, reduction="mean", softcap=None, onednn=1):
    """The impl's operator itself, with its config (three chunks of 64 over 150 tokens; the products by oneDNN or
    by torch's BLAS), told every gradient."""
    def fn(h, w, t, b):
        if impl is not CPU:
            return impl.fwd_op(h, w, t, b, None, ignore_index, reduction, softcap, *PLAIN, 64, chunk)[0]
        needs = 0b011 if b is None else 0b111
        return impl.fwd_op(h, w, t, b, None, ignore_index, reduction, softcap, *PLAIN, threads, chunk, onednn,
                           needs)[0]
    return fn


def expression(ignore_index=-100, reduction="mean", softcap=None):
    return lambda h, w, t, b: reference(h, w, t, b, None, ignore_index, reduction, softcap)[0]


def check(fn, ins, dtype, **attrs):
    """fn's loss and gradients within the dtype's tolerance of the expression in float64."""
    got_loss, got = grads(fn, *ins)
    ins64 = tuple(t.double() if t is not None and t.is_floating_point() else t for t in ins)
    ref_loss, ref = grads(expression(**attrs), *ins64)
    assert got_loss.dtype == dtype and all(g.dtype == dtype for g in got)
    assert rel_err(got_loss, ref_loss) < TOL[dtype], (got_loss, ref_loss)
    for name, g, r in zip(("hidden", "weight", "bias"), got, ref):
        assert rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("onednn", PRODUCTS)
def test_cpu_loss_and_every_gradient_match_float64(gen, dtype, bias, reduction, onednn):
    ins = inputs(gen, bias=bias, dtype=dtype)
    check(kernel(reduction=reduction, onednn=onednn), ins, dtype, reduction=reduction)


@pytest.mark.parametrize("onednn", PRODUCTS)
def test_hidden_weight_and_bias_in_any_layout(gen, onednn):
    """Every other row of a wider hidden, a weight stored transposed, a bias of stride 2: the products take them as
    they are (BLAS) or laid out for them (oneDNN); a vocabulary of several weight-gradient blocks, the last short."""
    def laid_out(h, w, t, b):
        hs = torch.stack([h, torch.zeros_like(h)], 1).flatten(0, 1)[::2]
        ws, bs = w.t().contiguous().t(), torch.stack([b, b], 1)[:, 0]
        assert not (hs.is_contiguous() or ws.is_contiguous() or bs.is_contiguous())
        return kernel(onednn=onednn, chunk=16)(hs, ws, t, bs)

    check(laid_out, inputs(gen, n=40, v=2 * block_rows(24, 16) + 37, bias=True), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_caps_the_logits_before_the_loss(gen, dtype):
    """Logits of spread about 10 against a cap of 5: most of them bent by the tanh."""
    h, w, t, b = inputs(gen, bias=True, dtype=dtype)
    ins = (h * 10, w, t, b)
    check(kernel(softcap=5.0), ins, dtype, softcap=5.0)


def test_other_ignore_index_and_one_chunk(gen):
    h, w, t, _ = inputs(gen, n=9, ignored=())
    t[[0, 4]] = 2
    check(kernel(ignore_index=2, chunk=1024, threads=1), (h, w, t, None), torch.float32, ignore_index=2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_all_ignored_batch_is_nan_or_zero_with_zero_gradients(gen, reduction):
    h, w, t, b = inputs(gen, n=5, bias=True)
    t[:] = -100
    got_loss, got = grads(kernel(reduction=reduction), h, w, t, b)
    ref_loss, ref = grads(expression(reduction=reduction), h.double(), w.double(), t, b.double())
    torch.testing.assert_close(got_loss.double(), ref_loss, equal_nan=True)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, equal_nan=True)


@pytest.mark.parametrize("n, v", [(0, 7), (1, 1), (1, 5)])
def test_empty_and_one_element_inputs(gen, n, v):
    for reduction in ("mean", "sum"):
        ins = inputs(gen, n=n, h=3, v=v, bias=True, ignored=())
        got_loss, got = grads(kernel(reduction=reduction), *ins)
        ref_loss, ref = grads(expression(reduction=reduction), *(t.double() if t.is_floating_point() else t
                                                                 for t in ins))
        torch.testing.assert_close(got_loss.double(), ref_loss, equal_nan=True, rtol=1e-5, atol=1e-6)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.double(), r, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_out_of_range_target_is_an_index_error(gen):
    h, w, t, _ = inputs(gen, n=4)
    t[1] = 70
    with pytest.raises(IndexError, match="70 is out of bounds"):
        kernel()(h, w, t, None)


def test_inference_computes_no_gradient(gen):
    h, w, t, b = inputs(gen, bias=True)
    out = CPU.fwd_op(h, w, t, b, None, -100, "mean", None, *PLAIN, 2, 64, 1, 0)
    assert [r.numel() for r in out[2:]] == [0, 0, 0, 0]  # no predictions asked, no gradients
    assert rel_err(out[0], reference(h.double(), w.double(), t, b.double(), None, -100, "mean", None)[0]) < 1e-5


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_opcheck(gen, bias):
    h, w, t, b = inputs(gen, n=20, bias=bias)
    needs = 0b111 if bias else 0b011
    torch.library.opcheck(CPU.fwd_op, (h.requires_grad_(), w.requires_grad_(), t,
                                       None if b is None else b.requires_grad_(), None, -100, "mean", 2.0, *PLAIN,
                                       2, 64, 1, needs))


def test_public_function_takes_the_kernel_when_on_and_the_expression_when_off(gen, switches):
    h, w, t, b = inputs(gen, bias=True)
    h.requires_grad_()
    for value in ("on", "off"):
        switches(NKI_AUTOTUNE_KERNEL_LINEAR_CROSS_ENTROPY=value)
        loss = nk.linear_cross_entropy(h, w, t, b, softcap=4.0)
        assert rel_err(loss, F.cross_entropy(4.0 * torch.tanh(F.linear(h, w, b) / 4.0), t)) < 1e-5


def test_compiled_is_one_graph_with_the_kernel_and_no_recompile(gen, switches):
    switches(NKI_AUTOTUNE_KERNEL_LINEAR_CROSS_ENTROPY="on")
    torch._dynamo.reset()
    counters.clear()
    graphs = Graphs()
    fn = torch.compile(lambda h, w, t: nk.linear_cross_entropy(h * 2.0, w, t) + 1.0, backend=graphs,
                       fullgraph=True, dynamic=False)
    h, w, t, _ = inputs(gen)
    h.requires_grad_(), w.requires_grad_()
    for _ in range(2):
        got = torch.autograd.grad(fn(h, w, t), (h, w))
        want = torch.autograd.grad(F.cross_entropy(F.linear(h * 2.0, w), t) + 1.0, (h, w))
        assert all(rel_err(g, r) < 1e-5 for g, r in zip(got, want))
    assert counters["graph_break"] == {} and len(graphs.dynamo) == 1
    assert str(CPU.kernel_op) in targets(graphs.forward[0]) and str(CPU.bwd_op) not in targets(graphs.backward[0])
    assert "aten.mm.default" not in targets(graphs.forward[0])  # no logits outside the kernel
    assert "aten.mul.Tensor" in targets(graphs.backward[0])  # the saved gradients times the loss's (Impl.scaled)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype, bias, reduction, softcap", [(torch.float32, True, "mean", None),
                                                            (torch.bfloat16, False, "sum", 4.0)], ids=str)
def test_nki_loss_and_every_gradient_match_float64_through_the_interpreter(gen, dtype, bias, reduction, softcap):
    """Three token tiles of 64 (the last short), a vocabulary of two forward chunks of 128 and gradient blocks of
    128 (the last short), a hidden dim over two K tiles of 128 (the bias column makes it 161)."""
    ins = inputs(gen, n=150, h=160, v=200, bias=bias, dtype=dtype)
    ins = (ins[0] * (3 if softcap else 1), *ins[1:])
    check(kernel(NKI, chunk=128, reduction=reduction, softcap=softcap), ins, dtype, reduction=reduction,
          softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [1.0, 3.0])
def test_cpu_gradients_are_the_saved_ones_times_the_loss_gradient(gen, dtype, seed):
    """``Impl.scaled``: the backward returns the gradients the forward saved, scaled in place by the loss's
    gradient, untouched where it is 1 (``loss.backward()``)."""
    ins = inputs(gen, bias=True, dtype=dtype)
    got_loss, got = grads(kernel(), *ins, seed=seed)
    ins64 = tuple(t.double() if t is not None and t.is_floating_point() else t for t in ins)
    _, ref = grads(expression(), *ins64, seed=seed)
    for name, g, r in zip(("hidden", "weight", "bias"), got, ref):
        assert g.dtype == dtype and rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))


def test_compiled_gradients_of_a_scaled_loss_match_float64(gen, switches):
    """Compiled, the loss times 3 and a bias: the backward graph's product of the saved gradients and the loss's
    gradient, no backward operator."""
    switches(NKI_AUTOTUNE_KERNEL_LINEAR_CROSS_ENTROPY="on")
    torch._dynamo.reset()
    counters.clear()
    graphs = Graphs()
    fn = torch.compile(lambda h, w, t, b: 3.0 * nk.linear_cross_entropy(h, w, t, b), backend=graphs,
                       fullgraph=True, dynamic=False)
    ins = inputs(gen, bias=True)
    for _ in range(2):
        got_loss, got = grads(fn, *ins, seed=1.0)
        ins64 = tuple(t.double() if t is not None and t.is_floating_point() else t for t in ins)
        ref_loss, ref = grads(lambda h, w, t, b: 3.0 * reference(h, w, t, b, None, -100, "mean", None)[0], *ins64,
                              seed=1.0)
        assert rel_err(got_loss, ref_loss) < 1e-5
        for name, g, r in zip(("hidden", "weight", "bias"), got, ref):
            assert rel_err(g, r) < 1e-5, (name, rel_err(g, r))
    assert counters["graph_break"] == {} and len(graphs.dynamo) == 1 and len(graphs.backward) == 1
    assert str(CPU.bwd_op) not in targets(graphs.backward[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_weight_gradient_is_held_once(gen, switches, compiled):
    """Peak memory of a forward and backward (the loss times 3): the weight gradient, one chunk's logits, one
    vocabulary block of the weight gradient's products and the hidden gradient, not the weight gradient twice
    (computed in the forward, scaled into a second buffer)."""
    from nki_autotune.autotune.memory import peak_bytes

    switches(NKI_AUTOTUNE_KERNEL_LINEAR_CROSS_ENTROPY="on")
    torch._dynamo.reset()
    n, hdim, v = 256, 512, 8192
    h, w, t, _ = inputs(gen, n=n, h=hdim, v=v)
    h.requires_grad_(), w.requires_grad_()

    def f(h, w, t):
        return 3.0 * nk.linear_cross_entropy(h, w, t)

    fn = torch.compile(f, fullgraph=True, dynamic=False) if compiled else f

    def step():
        h.grad = w.grad = None
        fn(h, w, t).backward()

    step()
    h.grad = w.grad = None
    peak = peak_bytes(step)
    weight_grad, logits = v * hdim * 4, min(n, CPU.default["chunk"]) * v * 4
    # oneDNN's: a block of the weight gradient and its operand made contiguous, the chunk's hidden transposed, and
    # the library's scratch
    onednn = (2 * BLOCK_BYTES + n * hdim * 4 + 2**20) if CPU.default["onednn"] else 0
    assert peak < weight_grad + logits + onednn + 2 * n * hdim * 4 + 2**20, (peak, weight_grad, logits)
    torch._dynamo.reset()


def test_a_second_backward_of_a_scaled_loss_raises_not_misleads(gen):
    """The saved gradients are scaled in place: a second backward through the graph (``retain_graph=True``) is
    autograd's error on a modified saved tensor where the loss's gradient is not 1, and right where it is, however
    many follow; a gradient handed out as the saved tensor itself and then changed in place is the same error."""
    h, w, t, _ = inputs(gen)
    h.requires_grad_(), w.requires_grad_()
    loss = kernel()(h, w, t, None)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward(retain_graph=True)
    assert torch.equal(w.grad, 2 * first)
    loss.backward(retain_graph=True)  # the accumulated gradient is not the saved one: a third adds it once more
    assert torch.equal(w.grad, 3 * first)
    got, = torch.autograd.grad(loss, w, retain_graph=True)  # the saved gradient itself, where the loss's is 1
    assert torch.equal(got, first)
    got.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, w)
    h.grad = w.grad = None
    loss = kernel()(h, w, t, None)
    (loss * 3).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss * 3).backward()


def test_the_default_chunk_keeps_its_logits_within_the_budget():
    """``fit``: at a 128256-token vocabulary the default config's chunk is 245 tokens (within 120 MiB of logits),
    at 32000 the default's 256, and never below 64."""
    from nki_autotune.kernels.linear_cross_entropy.cpu import LOGITS_BUDGET

    from .helpers import key_of

    for v, chunk in ((128256, 245), (32000, 256), (10**7, 64)):
        key = key_of("linear_cross_entropy", "training",
                     [((2048, 512), "float32"), ((v, 512), "float32"), ((2048,), "int64"), None])
        got = CPU.default_at(key)["chunk"]
        assert got == chunk and (got * v * 4 <= LOGITS_BUDGET or got == 64), (v, got)
