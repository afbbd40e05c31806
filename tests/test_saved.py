"""What a kernel call keeps for its backward, and gradients asked for alone: each impl saves only the tensors its
needed gradients read (``Impl.reads`` and autograd's ``needs_input_grad``), and is right with any subset of its
inputs needing a gradient."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.registry import Impl, Op, get_op, register_impl, register_op, scope

from .helpers import as64, rel_err

RNG = random.Random(random.SystemRandom().randrange(2**31))


def _rope_inputs(gen, hf=False, cos_batch=2):
    b, s, hq, hk, d = 2, RNG.randint(3, 9), 4, 2, 2 * RNG.randint(1, 8)
    if hf:
        q = torch.randn(b, s, hq * d, generator=gen).view(b, s, hq, d).transpose(1, 2)
        k = torch.randn(b, s, hk * d, generator=gen).view(b, s, hk, d).transpose(1, 2)
    else:
        q, k = torch.randn(b, hq, s, d, generator=gen), torch.randn(b, hk, s, d, generator=gen)
    ang = torch.rand(cos_batch, s, d // 2, generator=gen) * 6
    return q, k, torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def _cases(gen):
    """op name -> (inputs, attrs, the pack's function) at small random shapes."""
    n, d = RNG.randint(2, 40), RNG.randint(2, 90)
    g, u = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    return {
        "rmsnorm": ((torch.randn(n, d, generator=gen), 1 + 0.1 * torch.randn(d, generator=gen)), (1e-6,), nk.rmsnorm),
        "swiglu": ((g, u), (), nk.swiglu),
        "rope": (_rope_inputs(gen), (), nk.rope),
        "softmax": ((torch.randn(n, d, generator=gen),), (-1,), nk.softmax),
        "cross_entropy": ((torch.randn(n, d, generator=gen), torch.randint(0, d, (n,), generator=gen), None),
                          (-100, "mean"), nk.cross_entropy),
    }


def _subsets(k):
    """Every non-empty subset of k inputs (as a mask)."""
    return [m for m in itertools.product((False, True), repeat=k) if any(m)]


@pytest.mark.parametrize("name", ["rmsnorm", "swiglu", "rope", "softmax", "cross_entropy"])
def test_a_call_saves_only_what_its_needed_gradients_read(switches, name):
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    inputs, attrs, fn = _cases(gen)[name]
    op = get_op(name)
    impl = op.impls[next(i for i in op.impls if op.impls[i].backend == "cpu")]
    diff = [op.tensors.index(n) for n in op.differentiable]
    for mask in _subsets(len(diff)):
        leaves = list(None if t is None else t.detach().clone() for t in inputs)
        for i, need in zip(diff, mask):
            leaves[i].requires_grad_(need)
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*leaves, *attrs)
        outs = out if isinstance(out, tuple) else (out,)
        keep = impl.kept(tuple(mask))
        names = (*op.tensors, *(f"result_{i}" for i in range(op.outputs + impl.saved)))
        kept_inputs = {names[i] for i in keep if i < len(op.tensors)}
        ptrs = {t.untyped_storage().data_ptr() for t in saved}
        for i, t in enumerate(leaves):  # an input is saved exactly where a needed gradient reads it
            if t is None:
                continue
            assert (t.untyped_storage().data_ptr() in ptrs) == (op.tensors[i] in kept_inputs), (mask, op.tensors[i])
        for j, o in enumerate(outs):  # an output is saved only where a needed gradient reads it
            if o.untyped_storage().data_ptr() in ptrs:
                assert f"result_{j}" in {names[i] for i in keep}, (mask, j)
        assert len(saved) == len([i for i in keep if i >= len(leaves) or leaves[i] is not None])  # none for None


@pytest.mark.parametrize("name", ["rmsnorm", "swiglu", "rope"])
def test_each_subset_of_gradients_matches_float64(switches, name):
    """The backward with some gradients not needed (a frozen weight, cos/sin without gradient, ...)."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    inputs, attrs, fn = _cases(gen)[name]
    ref = get_op(name).reference
    for mask in _subsets(len(inputs)):
        leaves = [t.detach().clone().requires_grad_(m) for t, m in zip(inputs, mask)]
        leaves64 = [t.detach().double().requires_grad_(m) for t, m in zip(inputs, mask)]
        out, out64 = fn(*leaves, *attrs), ref(*leaves64, *attrs)
        outs, outs64 = (out, out64) if isinstance(out, tuple) else ((out,), (out64,))
        seeds = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
        # an output carries a gradient exactly where the expression's does (rope's k output none from q alone)
        assert [o.requires_grad for o in outs] == [o.requires_grad for o in outs64], mask
        live = [(o, o64, s) for o, o64, s in zip(outs, outs64, seeds) if o64.requires_grad]
        grads = torch.autograd.grad([o for o, _, _ in live], [t for t in leaves if t.requires_grad],
                                    [s.float() for _, _, s in live])
        grads64 = torch.autograd.grad([o for _, o, _ in live], [t for t in leaves64 if t.requires_grad],
                                      [s for _, _, s in live])
        for g, r in zip(grads, grads64):
            assert g.shape == r.shape and rel_err(g, r) < 1e-5, mask


@pytest.mark.parametrize("layout", ["hugging face", "contiguous", "expanded"])
def test_rope_gradients_come_out_in_the_layout_their_output_gradients_come_in(layout):
    """Hugging Face's attention hands RoPE its q/k gradients in the transposed layout of q and k: the kernel reads
    them in place and writes dq, dk in that layout, so neither side copies."""
    impl = get_op("rope").impls["cpu_positions"]
    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    q, k, cos, sin = _rope_inputs(gen, hf=True, cos_batch=1)
    q.requires_grad_(), k.requires_grad_()
    qo, ko = impl.fwd_op(q, k, cos, sin, 1, 8)

    def grad_like(t):
        if layout == "expanded":
            return torch.randn((), generator=gen).expand(t.shape)
        g = torch.randn(t.shape[0], t.shape[2], t.shape[1], t.shape[3], generator=gen).transpose(1, 2)
        return g if layout == "hugging face" else g.contiguous()

    gq, gk = grad_like(qo), grad_like(ko)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    ref = get_op("rope").reference
    q64, k64 = as64((q.detach(), k.detach()))
    q64.requires_grad_(), k64.requires_grad_()
    rq, rk = torch.autograd.grad(ref(q64, k64, cos.double(), sin.double()), (q64, k64), (gq.double(), gk.double()))
    assert rel_err(dq, rq) < 1e-5 and rel_err(dk, rk) < 1e-5
    if layout != "expanded":
        assert dq.stride() == gq.stride() and dk.stride() == gk.stride()
    else:
        assert dq.is_contiguous() and dk.is_contiguous()


@pytest.mark.parametrize("hf", [True, False])
def test_rope_outputs_keep_the_layout_of_their_inputs(hf):
    """A transposed q/k view is rotated into a tensor of the same layout, as PyTorch's element-wise ops keep it:
    read and written in one memory order, and no copy for the attention that reads it. The fake says so too."""
    impl = get_op("rope").impls["cpu_positions"]
    gen = torch.Generator().manual_seed(RNG.randrange(2**31))
    q, k, cos, sin = _rope_inputs(gen, hf=hf, cos_batch=RNG.choice([1, 2]))
    for grain in (1, 8):
        qo, ko = impl.fwd_op(q, k, cos, sin, RNG.choice([1, 2]), grain)
        rq, rk = get_op("rope").reference(*as64((q, k, cos, sin)))
        assert qo.stride() == q.stride() and ko.stride() == k.stride()
        assert rel_err(qo, rq) < 1e-6 and rel_err(ko, rk) < 1e-6
    torch.library.opcheck(impl.fwd_op, (q.requires_grad_(), k.requires_grad_(), cos, sin, 2, 8))


def test_operators_are_named_by_what_compiled_graphs_bake_in():
    """torch.compile caches a graph's backward under its forward graph's key: the forward operator's name must
    change with anything of the impl's backward, or a warm cache from another version calls the new kernel
    with what the old one read."""
    from dataclasses import replace

    from nki_autotune.registry import customop

    impl = get_op("swiglu").impls["cpu_fused"]
    v = customop.version(impl)
    assert impl.fwd_op._overloadname == impl.bwd_op._overloadname == v
    assert str(impl.fwd_op) == f"nki_autotune.swiglu_cpu_fused.{v}"
    assert torch.ops.nki_autotune.swiglu_cpu_fused is impl.fwd_op.overloadpacket
    other = replace(impl, reads={"gate": ("gate", "up"), "up": ("gate", "up")})  # not registered: only hashed
    assert customop.version(other) != v
    assert customop.version(replace(impl, saved=1)) != v


def test_reads_must_name_every_differentiable_input():
    from dataclasses import replace

    impl = get_op("swiglu").impls["cpu_fused"]
    with pytest.raises(ValueError, match=r"reads must name .* missing \['up'\]"):
        replace(impl, reads={"gate": ("gate", "up")})


def test_double_backward_is_refused_not_zero():
    """A kernel's backward has no gradient of its own: create_graph=True must fail, not give zeros."""
    g = torch.randn(4, 8, requires_grad=True)
    u = torch.randn(4, 8, requires_grad=True)
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        y = nk.swiglu(g, u)
        (dg,) = torch.autograd.grad(y.sum(), g, create_graph=False)  # a first-order gradient still works
        torch.testing.assert_close(dg, torch.autograd.grad(get_op("swiglu").reference(g, u).sum(), g)[0])
        y = nk.swiglu(g, u)
        with pytest.raises(RuntimeError, match="has no gradient of its own"):
            torch.autograd.grad(y.sum(), g, create_graph=True)


def _add(x, y):
    return x + y


ADD = register_op(Op(name="saved_alias_probe", reference=_add, tensors=("x", "y"), differentiable=("x", "y")))
register_impl(Impl(op=ADD, name="cpu_add", backend="cpu", supports=lambda specs, attrs: None,
                   forward=lambda tensors, attrs, config: (tensors[0] + tensors[1],),
                   fake=lambda tensors, attrs: (torch.empty_like(tensors[0]),)))


def test_reference_gradients_are_new_tensors():
    """The backward operator's schema promises new tensors; the reference's gradient of x + y is the output
    gradient itself, twice."""
    x, y = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    out = ADD.impls["cpu_add"].fwd_op(x, y)
    seed = torch.randn(3, 5)
    dx, dy = torch.autograd.grad(out, (x, y), seed)
    ptrs = {t.untyped_storage().data_ptr() for t in (seed, dx, dy, x, y)}
    assert len(ptrs) == 5
    torch.testing.assert_close(dx, seed) and torch.testing.assert_close(dy, seed)
