"""nk.cross_entropy with ``softcap`` (Gemma 2 and 3's capped logits): the loss and the logits' gradient against the
op's expression, ``F.cross_entropy(cap * tanh(logits / cap), ...)``, in float64, on the CPU kernel (every config:
one and two threads, one pass and two over rows longer than the one-pass parts) and the NKI kernel (through the
interpreter: a compiled loop of full vocabulary chunks and a tail, row tiles with a short last one); ignored rows,
an all-ignored batch, and the public function on its kernel."""

from __future__ import annotations

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.kernels.cross_entropy.op import reference
from nki_autotune.kernels.shared.loss import OPTIONS
from nki_autotune.kernels.shared.sumexp_cpu import PART
from nki_autotune.registry import explain, get_op

from .helpers import rel_err

OP = get_op("cross_entropy")
CPU = OP.impls["cpu_rows"]
NKI = OP.impls["nki_online"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
PLAIN = tuple(OPTIONS.values())  # every option off


def inputs(gen, n=70, v=2 * PART + 37, dtype=torch.float32, spread=8.0, ignored=(3, 40), ignore_index=-100):
    """Logits of ``spread`` (most bent by a cap of a few units), targets with the rows ``ignored`` ignored."""
    x = (spread * torch.randn(n, v, generator=gen)).to(dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    t[[i for i in ignored if i < n]] = ignore_index
    return x, t


def grads(fn, x, t, seed=2.5):
    """The loss and the gradient of ``seed * loss`` for the logits."""
    leaf = x.detach().clone().requires_grad_()
    loss = fn(leaf, t)
    (got,) = torch.autograd.grad(loss * seed, leaf)
    return loss.detach(), got


def kernel(impl, config, ignore_index=-100, reduction="mean", softcap=3.0):
    return lambda x, t: impl.fwd_op(x, t, None, ignore_index, reduction, softcap, *PLAIN, *config)[0]


def check(fn, x, t, dtype, ignore_index=-100, reduction="mean", softcap=3.0):
    got_loss, got = grads(fn, x, t)
    ref_loss, ref = grads(lambda a, b: reference(a, b, None, ignore_index, reduction, softcap)[0], x.double(), t)
    assert got_loss.dtype == dtype and got.dtype == dtype
    assert rel_err(got_loss, ref_loss) < TOL[dtype], (got_loss, ref_loss)
    assert rel_err(got, ref) < TOL[dtype], rel_err(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("threads, online", [(1, 0), (2, 1)])
def test_cpu_capped_loss_and_gradient_match_float64(gen, dtype, reduction, threads, online):
    x, t = inputs(gen, dtype=dtype)
    check(kernel(CPU, (threads, online), reduction=reduction), x, t, dtype, reduction=reduction)


@pytest.mark.parametrize("cap", [0.25, 30.0])
def test_cpu_caps_far_below_and_far_above_the_logits(gen, cap):
    """A cap far below the logits' spread (nearly every logit saturated: gradients of 1 - tanh^2 near 0) and
    Gemma's 30, far above (nearly the plain loss)."""
    x, t = inputs(gen, n=20, v=300)
    check(kernel(CPU, (1, 1), softcap=cap), x, t, torch.float32, softcap=cap)


def test_cpu_other_ignore_index(gen):
    x, t = inputs(gen, n=9, v=40, ignored=(0, 4), ignore_index=2)
    check(kernel(CPU, (2, 0), ignore_index=2), x, t, torch.float32, ignore_index=2)


@pytest.mark.parametrize("impl, config", [(CPU, (2, 1)), (NKI, (128, 512))], ids=["cpu", "nki"])
def test_an_all_ignored_batch_is_nan_or_zero_with_zero_gradients(gen, impl, config):
    x, t = inputs(gen, n=5, v=30)
    t[:] = -100
    for reduction in ("mean", "sum") if impl is CPU else ("mean",):  # the NKI kernel takes the mean
        got_loss, got = grads(kernel(impl, config, reduction=reduction), x, t)
        ref_loss, ref = grads(lambda a, b, r=reduction: reference(a, b, None, -100, r, 3.0)[0], x.double(), t)
        torch.testing.assert_close(got_loss.double(), ref_loss, equal_nan=True)
        torch.testing.assert_close(got.double(), ref, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nki_capped_loss_and_gradient_match_float64_through_the_interpreter(gen, dtype):
    """150 rows in tiles of 64 (the last short); 1100 columns: two full chunks of 512 in the compiled loop, a
    tail of 76."""
    x, t = inputs(gen, n=150, v=1100, dtype=dtype)
    check(kernel(NKI, (64, 512)), x, t, dtype)


def test_public_function_takes_the_kernel_with_a_softcap(gen, switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    x, t = inputs(gen, n=9, v=30, ignored=(2,))
    x.requires_grad_()
    for reduction in ("mean", "sum"):
        assert explain("cross_entropy", x, t, reduction=reduction, softcap=3.0).path == "kernel"
        loss = nk.cross_entropy(x, t, reduction=reduction, softcap=3.0)
        want = reference(x.double(), t, None, -100, reduction, 3.0)[0]
        (got,), (ref,) = torch.autograd.grad(loss, x), torch.autograd.grad(want, x)
        assert rel_err(loss, want) < 1e-5 and rel_err(got, ref) < 1e-5
    exp = explain("cross_entropy", x, t, softcap=0.0)
    assert exp.path == "compiler" and "softcap" in exp.reason  # a cap of 0 divides by 0: the expression's nan
