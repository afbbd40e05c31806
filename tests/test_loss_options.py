"""The losses' options (PyTorch's class weights, label smoothing, ``reduction="none"``; the z-loss, predicted tokens
and token accuracy): ``nk.cross_entropy`` and ``nk.linear_cross_entropy`` on their CPU kernels against PyTorch's
expression in float64 over drawn shapes and options, forward and backward; the public functions' answers and
argument names; what the kernels decline, and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nki_autotune.kernels as nk
from nki_autotune.kernels import LossOutput
from nki_autotune.registry import Key, TensorSpec, explain, get_op

from .helpers import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def expected(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap):
    """PyTorch's loss with its options, plus the z-loss as Liger defines it (the mean over counted tokens, not
    weighted), in the logits' dtype (float64 here); and the z-loss alone."""
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(z, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    valid = target != ignore_index
    zl = torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    zl = zl if reduction == "none" else zl.sum() / valid.sum() if reduction == "mean" else zl.sum()
    return loss + zl, zl


options = st.fixed_dictionaries({
    "reduction": st.sampled_from(["mean", "sum", "none"]),
    "label_smoothing": st.sampled_from([0.0, 0.1, 0.3]),
    "lse_square_scale": st.sampled_from([0.0, 1e-4, 1e-2]),
    "softcap": st.sampled_from([None, 5.0, 30.0]),
    "ignore_index": st.sampled_from([-100, 0, 42]),
    "weighted": st.booleans(),
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
})


def _targets(gen, n, v, ignore_index):
    t = torch.randint(0, v, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < 0.2] = ignore_index
    t[0] = 1 if ignore_index != 1 else 2  # one counted token at least
    return t.clamp(max=v - 1).masked_fill(t == ignore_index, ignore_index)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(o=options, n=st.integers(1, 70), v=st.integers(3, 700), seed=st.integers(0, 2**31 - 1))
def test_cross_entropy_options_match_float64(switches, o, n, v, seed):
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n, v, generator=gen)).to(o["dtype"])
    t = _targets(gen, n, v, o["ignore_index"])
    w = torch.rand(v, generator=gen) + 0.1 if o["weighted"] else None
    kw = {k: o[k] for k in ("reduction", "label_smoothing", "lse_square_scale", "softcap", "ignore_index")}
    assert explain("cross_entropy", x.requires_grad_(), t, w, o["ignore_index"], o["reduction"], o["softcap"],
                   o["label_smoothing"], o["lse_square_scale"], True).path == "kernel"
    leaf = x.detach().clone().requires_grad_()
    out = nk.cross_entropy(leaf, t, w, return_z_loss=True, return_predicted_tokens=True, **kw)
    ref_leaf = x.detach().double().requires_grad_()
    ref, ref_z = expected(ref_leaf, t, None if w is None else w.double(), **{k: kw[k] for k in (
        "ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap")})
    seed_grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (out.loss.double() * seed_grad).sum().backward()
    (ref * seed_grad).sum().backward()
    tol = TOL[o["dtype"]]
    assert out.loss.dtype == o["dtype"] and out.loss.shape == ref.shape
    assert rel_err(out.loss, ref) < tol and rel_err(leaf.grad, ref_leaf.grad) < tol
    assert rel_err(out.z_loss, ref_z.detach()) < tol if o["lse_square_scale"] else not out.z_loss.any()
    z = x.float() if o["softcap"] is None else o["softcap"] * torch.tanh(x.float() / o["softcap"])
    valid = t != o["ignore_index"]
    assert torch.equal(out.predicted_tokens[~valid], torch.full_like(t[~valid], -1))
    # the argmax of the capped float32 logits the kernel sees (where two tie, either)
    picked = z[valid].gather(1, out.predicted_tokens[valid].unsqueeze(1)).squeeze(1)
    assert torch.equal(picked, z[valid].amax(-1))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(o=options, n=st.integers(1, 80), h=st.integers(1, 40), v=st.integers(3, 500), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_linear_cross_entropy_options_match_float64(switches, o, n, h, v, bias, seed):
    """Every gradient in training (mean and sum), the loss alone for ``none`` (in inference)."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(seed)
    dtype, train = o["dtype"], o["reduction"] != "none"
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (3 * torch.randn(v, h, generator=gen) / h ** 0.5).to(dtype)
    b = (0.3 * torch.randn(v, generator=gen)).to(dtype) if bias else None
    t = _targets(gen, n, v, o["ignore_index"])
    w = torch.rand(v, generator=gen) + 0.1 if o["weighted"] else None
    kw = {k: o[k] for k in ("reduction", "label_smoothing", "lse_square_scale", "softcap", "ignore_index")}
    leaves = [None if a is None else a.detach().clone().requires_grad_(train) for a in (hidden, weight, b)]
    assert explain("linear_cross_entropy", *leaves[:2], t, leaves[2], w, o["ignore_index"], o["reduction"],
                   o["softcap"], o["label_smoothing"], o["lse_square_scale"], True).path == "kernel"
    out = nk.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], weight=w, return_z_loss=True,
                                  return_token_accuracy=True, **kw)
    refs = [None if a is None else a.detach().double().requires_grad_(train) for a in (hidden, weight, b)]
    ref, ref_z = expected(F.linear(*refs), t, None if w is None else w.double(), **{k: kw[k] for k in (
        "ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap")})
    tol = TOL[dtype]
    assert out.loss.dtype == dtype and rel_err(out.loss, ref) < tol
    assert rel_err(out.z_loss, ref_z.detach()) < tol if o["lse_square_scale"] else not out.z_loss.any()
    if train:
        out.loss.backward(torch.tensor(1.7, dtype=dtype))
        (1.7 * ref).backward()
        for got, r in zip(leaves, refs):
            if got is not None:
                assert rel_err(got.grad, r.grad) < tol


def test_the_z_loss_is_inside_the_loss_and_carries_no_gradient_of_its_own(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    x = torch.randn(30, 50, generator=gen, requires_grad=True)
    t = torch.randint(0, 50, (30,), generator=gen)
    out = nk.cross_entropy(x, t, lse_square_scale=1e-2, return_z_loss=True)
    plain = nk.cross_entropy(x, t)
    torch.testing.assert_close(out.loss - plain, out.z_loss)
    assert out.loss.requires_grad and not out.z_loss.requires_grad


def test_public_functions_answer_a_tensor_unless_more_is_asked(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    h, w = torch.randn(12, 8, generator=gen), torch.randn(20, 8, generator=gen)
    t = torch.randint(0, 20, (12,), generator=gen)
    t[3] = -100
    assert isinstance(nk.linear_cross_entropy(h, w, t), torch.Tensor)
    out = nk.linear_cross_entropy(h, w, t, return_token_accuracy=True, return_predicted_tokens=True)
    assert isinstance(out, LossOutput) and out.z_loss is None
    logits = h @ w.t()
    predicted = logits.argmax(-1).masked_fill(t == -100, -1)
    assert torch.equal(out.predicted_tokens, predicted)
    counted = t != -100
    torch.testing.assert_close(out.token_accuracy, (predicted == t)[counted].float().mean())
    per_token = nk.linear_cross_entropy(h, w, t, reduction="none", return_token_accuracy=True).token_accuracy
    assert torch.equal(per_token, ((predicted == t) & counted).float())


def test_linear_cross_entropy_takes_pytorchs_argument_names(switches, gen):
    """``F.linear_cross_entropy(input, linear_weight, target, linear_bias=, weight=, ignore_index=None, ...)``:
    one import changes."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    h, w = torch.randn(16, 8, generator=gen), torch.randn(30, 8, generator=gen)
    b, cw = torch.randn(30, generator=gen), torch.rand(30, generator=gen)
    t = torch.randint(0, 30, (16,), generator=gen)
    t[2] = -100
    kw = dict(linear_bias=b, weight=cw, reduction="sum", ignore_index=None, label_smoothing=0.2)
    got = nk.linear_cross_entropy(h, w, t, **kw)
    torch.testing.assert_close(got, F.linear_cross_entropy(h, w, t, **kw))
    got = nk.linear_cross_entropy(h, linear_weight=w, target=t, **kw,
                                  options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=4))
    torch.testing.assert_close(got, F.linear_cross_entropy(h, w, t, **kw))


def test_refusals_name_what_is_served(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    h, w = torch.randn(6, 4, generator=gen, requires_grad=True), torch.randn(9, 4, generator=gen)
    t = torch.randint(0, 9, (6,), generator=gen)
    with pytest.raises(ValueError, match=r"accum_dtype=torch.bfloat16 \(supports None or torch.float32"):
        nk.linear_cross_entropy(h, w, t, accum_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bias or as linear_bias, not both"):
        nk.linear_cross_entropy(h, w, t, torch.zeros(9), linear_bias=torch.zeros(9))
    exp = explain("linear_cross_entropy", h, w, t, None, None, -100, "none")
    assert exp.path == "compiler" and "reduction='none' in training" in exp.reason
    loss = nk.linear_cross_entropy(h, w, t, reduction="none")  # the compiler's per-token gradients
    loss.backward(torch.arange(6.0))
    ref_h = h.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(ref_h, w), t, reduction="none").backward(torch.arange(6.0))
    torch.testing.assert_close(h.grad, ref_h.grad)


@pytest.mark.parametrize("name", ["cross_entropy.nki_online", "linear_cross_entropy.nki_tiled"])
def test_nki_kernels_decline_the_options_they_do_not_serve(name):
    op_name, impl_name = name.split(".")
    op = get_op(op_name)
    impl = op.impls[impl_name]
    specs = ((TensorSpec((8, 16), "float32"), TensorSpec((8,), "int64"), TensorSpec((16,), "float32"))
             if op.name == "cross_entropy" else
             (TensorSpec((8, 4), "float32"), TensorSpec((16, 4), "float32"), TensorSpec((8,), "int64"), None,
              TensorSpec((16,), "float32")))
    plain = tuple(None if i == len(specs) - 1 else s for i, s in enumerate(specs))
    key = Key.of(op, specs, dict(op.defaults), "training")
    assert "class weights" in impl.supports(key.inputs, key.attr_dict)
    for option, value in (("label_smoothing", 0.1), ("lse_square_scale", 1e-4), ("predictions", True),
                          ("reduction", "none")):
        attrs = {**op.defaults, option: value}
        assert option in impl.supports(plain, attrs), option


def test_class_weights_that_need_a_gradient_are_refused_as_pytorch_refuses_them(switches, gen):
    """PyTorch's loss has no gradient for its class weights: asked for one, both refuse (a kernel's class weights
    are constants, and it would give none silently)."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    x = torch.randn(10, 7, generator=gen, requires_grad=True)
    t = torch.randint(0, 7, (10,), generator=gen)
    cw = torch.rand(7, generator=gen).requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        F.cross_entropy(x, t, cw)
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        nk.cross_entropy(x, t, cw)
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        nk.linear_cross_entropy(torch.randn(10, 3), torch.randn(7, 3, requires_grad=True), t, weight=cw)


def test_options_compile_in_one_graph(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    h, w = torch.randn(32, 8, generator=gen), torch.randn(50, 8, generator=gen, requires_grad=True)
    t = torch.randint(0, 50, (32,), generator=gen)
    cw = torch.rand(50, generator=gen)

    def f(h, w):
        out = nk.linear_cross_entropy(h, w, t, weight=cw, label_smoothing=0.1, lse_square_scale=1e-4,
                                      return_z_loss=True, return_token_accuracy=True)
        return out.loss, out.z_loss, out.token_accuracy

    loss, zl, acc = torch.compile(f, fullgraph=True)(h, w)
    eager = f(h, w)
    for a, b in zip((loss, zl, acc), eager):
        torch.testing.assert_close(a, b)
    loss.backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
