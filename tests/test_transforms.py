"""torch.func transforms and forward-mode AD: the kernels' operators have a backward but no forward-mode or
functorch rule, so under a transform every pack call takes the expression (eager and compiled) and gives its
derivatives, rather than dropping tangents or refusing to run."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import nki_autotune.kernels as nk
from nki_autotune.registry import explain

from .calls import PACK, fresh, ids
from .helpers import rel_err


def _split(c):
    """The differentiable floating inputs of call ``c`` (what a transform differentiates) and a function that puts
    them back."""
    floats = [i for i, (t, n) in enumerate(zip(c.tensors, c.op.tensors))
              if t is not None and t.is_floating_point() and n in c.op.differentiable]

    def full(*fs):
        args = list(c.tensors)
        for i, f in zip(floats, fs):
            args[i] = f
        return args

    return tuple(c.tensors[i] for i in floats), full


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("op", PACK, ids=ids())
def test_jvp_and_grad_give_the_expressions_derivatives(switches, op):
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(11)
    c = fresh(op, "transforms", 1)[0]
    ref, fn = c.reference, c.kernel_or_compiler
    floats, full = _split(c)
    tangents = tuple(torch.randn(f.shape, generator=gen) for f in floats)
    try:
        _, want = torch.func.jvp(lambda *fs: _first(ref(*full(*fs))), floats, tangents)
    except NotImplementedError:  # PyTorch's own (its CPU flash attention has no forward-mode rule): refused alike
        with pytest.raises(NotImplementedError):
            torch.func.jvp(lambda *fs: _first(fn(*full(*fs))), floats, tangents)
        want = _first(ref(*c.tensors))
    else:
        _, got = torch.func.jvp(lambda *fs: _first(fn(*full(*fs))), floats, tangents)
        assert rel_err(got, want) < 1e-5  # a row of one element's softmax: a zero derivative, compared absolutely

    weights = torch.randn(want.shape, generator=gen)
    got = torch.func.grad(lambda *fs: (_first(fn(*full(*fs))) * weights).sum(), argnums=0)(*floats)
    want = torch.func.grad(lambda *fs: (_first(ref(*full(*fs))) * weights).sum(), argnums=0)(*floats)
    assert rel_err(got, want) < 1e-5


def test_forward_ad_dual_tensors_carry_their_tangent_and_explain_says_why(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    x, t = torch.randn(3, 8), torch.randn(3, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        tangent = fwAD.unpack_dual(nk.softmax(dual)).tangent
        assert explain("softmax", dual).path == "compiler" and "forward-mode AD" in explain("softmax", dual).reason
    _, want = torch.func.jvp(lambda a: torch.softmax(a, -1), (x,), (t,))
    assert tangent is not None and rel_err(tangent, want) < 1e-5
    assert explain("softmax", x).path == "kernel"  # outside the transform, the kernel again


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_a_transform_inside_a_compiled_region_traces_the_expression(switches, transform):
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(3)
    x, w, t = torch.randn(4, 16, generator=gen), torch.randn(16, generator=gen), torch.randn(16, generator=gen)

    def norm(w, rms):
        return (rms(x, w) * x).sum()

    def derivative(rms, w):
        f = lambda w: norm(w, rms)  # noqa: E731
        return torch.func.grad(f)(w) if transform == "grad" else torch.func.jvp(f, (w,), (t,))[1]

    got = torch.compile(lambda w: derivative(nk.rmsnorm, w), fullgraph=True, dynamic=False)(w)
    want = derivative(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, w)
    assert want.abs().sum() > 0 and rel_err(got, want) < 1e-5


def test_calls_under_a_transform_are_not_recorded(tmp_path, switches):
    """They never take a kernel, so they are no call site to tune (and a vmapped index is no sample to save)."""
    from nki_autotune.registry import load_profile, ops, record

    w, ids = torch.randn(50, 8), torch.randint(0, 50, (3, 4))
    x = torch.randn(4, 16)
    with record(tmp_path / "p.yaml", samples=True):
        torch.func.vmap(lambda i: nk.embedding(i, w))(ids)
        torch.func.grad(lambda a: nk.softmax(a, -1)[:, 0].sum())(x)
        nk.softmax(x, -1)
    (site,) = load_profile(tmp_path / "p.yaml", ops()).sites
    assert site.op == "softmax" and site.calls == 1


def test_an_op_names_the_sources_of_each_output_among_its_tensors():
    from nki_autotune.registry import Op

    with pytest.raises(ValueError, match="sources names 1 outputs' inputs; it has 2 outputs"):
        Op("pair", lambda a, b: (a, b), ("a", "b"), outputs=2, sources=(("a",),))
    with pytest.raises(ValueError, match="sources name c, not among its tensors a, b"):
        Op("pair", lambda a, b: (a, b), ("a", "b"), outputs=2, sources=(("a",), ("c",)))
