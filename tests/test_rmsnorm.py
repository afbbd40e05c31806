"""RMSNorm: the numba impl against the float64 reference, forward and backward, switches on and off."""

from __future__ import annotations

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.kernels.rmsnorm.op import RMSNORM, reference
from nki_autotune.registry import explain

from .helpers import as64, float32_floor, rel_err, run_with_grads

IMPL = RMSNORM.impls["cpu_rows"]

SHAPES = [(1, 2), (1, 7), (3, 5), (17, 129), (2, 3, 64), (4, 1, 33, 250), (300, 1024), (5,)]


def _inputs(shape, gen, dtype=torch.float32):
    x = torch.randn(shape, generator=gen, dtype=dtype) * 3 + 0.5
    w = torch.randn(shape[-1], generator=gen, dtype=dtype)
    return x, w


@pytest.mark.parametrize("switch", ["on", "off"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(switches, gen, shape, switch):
    switches(NKI_AUTOTUNE_KERNELS=switch)
    x, w = _inputs(shape, gen)
    eps = float(torch.empty(()).uniform_(1e-6, 1e-3, generator=gen))
    assert explain("rmsnorm", x.requires_grad_(), w, eps=eps).path == ("kernel" if switch == "on" else "compiler")
    outs, grads = run_with_grads(lambda a, b: nk.rmsnorm(a, b, eps), (x, w))
    ref = lambda a, b: reference(a, b, eps)  # noqa: E731
    ref_outs, ref_grads = run_with_grads(ref, as64((x, w)))
    # dx is w * dy projected off x: with two elements per row it can nearly vanish, and then float32
    # itself (PyTorch's expression included) cannot reach 1e-5; the bar is 4x what float32 reaches there
    tol = max(1e-5, 4 * float32_floor(ref, (x, w)))
    assert outs[0].dtype == torch.float32 and outs[0].shape == x.shape
    assert rel_err(outs[0], ref_outs[0]) < tol
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        assert rel_err(g, r) < tol


@pytest.mark.parametrize("config", IMPL.configs())
def test_every_config_is_correct(gen, config):
    x, w = _inputs((70, 96), gen)
    cfg = tuple(config.values())
    outs, grads = run_with_grads(lambda a, b: IMPL.fwd_op(a, b, 1e-6, 0.0, *cfg)[0], (x, w))
    ref_outs, ref_grads = run_with_grads(lambda a, b: reference(a, b, 1e-6), as64((x, w)))
    assert rel_err(outs[0], ref_outs[0]) < 1e-5
    assert all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("rows_per_task", [1, 256])
def test_weight_gradient_summed_in_parallel_and_serially(gen, rows_per_task):
    """Many partial rows (512 x 512) are summed by a parallel launch, few (2 x 512) in one thread: both exact."""
    from nki_autotune.kernels.rmsnorm import cpu

    x, w = _inputs((512, 512), gen)
    parallel = 512 // rows_per_task * 512 >= cpu._PARALLEL_SUM
    assert parallel == (rows_per_task == 1)
    outs, grads = run_with_grads(lambda a, b: IMPL.fwd_op(a, b, 1e-6, 0.0, 2, rows_per_task)[0], (x, w))
    ref_outs, ref_grads = run_with_grads(lambda a, b: reference(a, b, 1e-6), as64((x, w)))
    assert all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 64)])
def test_opcheck(gen, shape):
    x, w = _inputs(shape, gen)
    torch.library.opcheck(IMPL.fwd_op, (x.requires_grad_(), w.requires_grad_(), 1e-6, 1.0, 1, 4))
    torch.library.opcheck(IMPL.fwd_op, (x.detach(), w.detach(), 1e-5, 0.0, 2, 1))


def test_only_weight_requires_grad(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    x, w = _inputs((9, 40), gen)
    w.requires_grad_()
    nk.rmsnorm(x, w).pow(2).sum().backward()
    w64 = w.detach().double().requires_grad_()
    reference(x.double(), w64, 1e-6).pow(2).sum().backward()
    assert rel_err(w.grad, w64.grad) < 1e-5


_ROW_VIEWS = {
    "2-D slice": ((12, 100), lambda big: big[:, 10:74]),
    "3-D slice": ((2, 3, 100), lambda big: big[..., 10:74]),
    "one row expanded": ((1, 64), lambda big: big.expand(5, 64)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("view", list(_ROW_VIEWS))
def test_gradient_flows_through_a_strided_rows_view(switches, gen, view, dtype):
    """Rows whose leading dims collapse into one row axis at a stride other than the row's length (a slice of a
    wider tensor, 2-D or 3-D: rows 100 elements apart; one row expanded: stride 0), the last dim contiguous: the
    kernel reads them in place, forward and backward."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    shape, make = _ROW_VIEWS[view]
    big = _inputs(shape, gen, dtype)[0].requires_grad_()
    w = torch.randn(64, generator=gen, dtype=dtype, requires_grad=True)
    x = make(big)
    assert not x.is_contiguous()
    assert explain("rmsnorm", x, w).path == "kernel"
    got = nk.rmsnorm(x, w)
    g = torch.randn(got.shape, generator=gen, dtype=dtype)
    dbig, dw = torch.autograd.grad(got, (big, w), g)
    big64, w64 = big.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference(make(big64), w64, 1e-6)
    dbig_ref, dw_ref = torch.autograd.grad(ref, (big64, w64), g.double())
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    assert rel_err(got, ref) < tol
    assert rel_err(dbig, dbig_ref) < tol and rel_err(dw, dw_ref) < tol


def _hf_heads(gen, dtype, b=2, s=5, h=3, d=24):
    """Hugging Face's per-head q: ``q_proj(x).view(b, s, h, d).transpose(1, 2)`` ([b, h, s, d] over [b, s, h, d])."""
    return _inputs((b, s, h * d), gen, dtype)[0].view(b, s, h, d).transpose(1, 2)


def _fused_heads(gen, dtype, b=2, s=4, h=2, d=16):
    """The q part of a fused qkv projection as Phi-3 splits it, per head: rows with gaps between heads and positions."""
    qkv = _inputs((b, s, 3 * h * d), gen, dtype)[0]
    return qkv[..., : h * d].view(b, s, h, d).transpose(1, 2)


STRIDED_ROWS = {
    "hf-heads": _hf_heads,
    "hf-heads-one-batch": lambda g, dt: _hf_heads(g, dt, b=1, s=9),
    "fused-heads": _fused_heads,
    "transposed-3d": lambda g, dt: _inputs((4, 6, 32), g, dt)[0].transpose(0, 1),
    "expanded": lambda g, dt: _inputs((3, 1, 40), g, dt)[0].expand(3, 5, 40).transpose(0, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("weight, offset", [(True, 0.0), (True, 1.0), (False, 0.0)],
                         ids=["llama", "gemma", "no-weight"])
@pytest.mark.parametrize("layout", STRIDED_ROWS)
def test_rows_whose_leading_dims_do_not_collapse_are_read_in_place(switches, gen, layout, weight, offset, dtype):
    """Contiguous rows whose leading dims no single stride spans (Gemma 3's per-head q/k norms): the kernel reads
    them where they are, forward and backward, against float64; the outputs and x's gradient are contiguous."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    x = STRIDED_ROWS[layout](gen, dtype)
    assert x.stride(-1) == 1 and not x.is_contiguous()
    w = (0.1 * torch.randn(x.shape[-1], generator=gen, dtype=dtype) + (1 - offset)).requires_grad_() if weight \
        else None
    x = x.detach().requires_grad_()
    exp = explain("rmsnorm", x, w, eps=1e-5, offset=offset)
    assert exp.path == "kernel" and exp.impl == "cpu_rows", exp
    x64 = x.detach().double().requires_grad_()  # (run_with_grads would clone x into another layout)
    w64 = w.detach().double().requires_grad_() if weight else None
    y, want = nk.rmsnorm(x, w, 1e-5, offset), reference(x64, w64, 1e-5, offset)
    seed = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    (y.double() * seed).sum().backward()
    (want * seed.to(dtype).double()).sum().backward()  # the gradient y receives, rounded to its dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous() and rel_err(y, want) < tol
    assert all(rel_err(a.grad, b.grad) < tol for a, b in ((x, x64), (w, w64)) if a is not None)


def test_opcheck_of_rows_that_do_not_collapse(gen):
    x = _hf_heads(gen, torch.float32).detach()
    w = torch.randn(x.shape[-1], generator=gen)
    torch.library.opcheck(IMPL.fwd_op, (x.requires_grad_(), w.requires_grad_(), 1e-6, 1.0, 1, 4))
    torch.library.opcheck(IMPL.fwd_op, (x.detach(), w.detach(), 1e-5, 0.0, 2, 1))


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda g: _inputs((4, 32), g, torch.float64), "dtypes float64"),
        (lambda g: (_inputs((4, 32), g)[0], _inputs((4, 32), g, torch.bfloat16)[1]), "dtypes float32, bfloat16"),
        (lambda g: (torch.randn(32, 4, generator=g).t(), torch.randn(32, generator=g)), "not contiguous"),
        (lambda g: (_inputs((4, 32), g)[0], torch.ones(1)), "no broadcasting"),
        (lambda g: (torch.randn((), generator=g), torch.ones(())), "needs at least one dim"),
    ],
)
def test_declined_inputs_take_the_compiler_path(switches, gen, make, why):
    switches(NKI_AUTOTUNE_KERNELS="on")
    x, w = make(gen)
    exp = explain("rmsnorm", x, w)
    assert exp.path == "compiler" and why in exp.reason
    got = nk.rmsnorm(x, w)
    torch.testing.assert_close(got, reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("weight, offset", [(True, 1.0), (True, -0.5), (False, 0.0)],
                         ids=["gemma", "offset", "no-weight"])
@pytest.mark.parametrize("shape", [(3, 5), (2, 33, 129)])
def test_offset_and_no_weight_match_float64(switches, gen, shape, weight, offset, dtype):
    """``x * rsqrt(mean(x^2) + eps) * (offset + w)`` (Gemma: offset 1, weights near 0), and no weight at all
    (``torch.nn.RMSNorm(elementwise_affine=False)``), forward and backward, against float64."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    x, w = _inputs(shape, gen, dtype)
    w = (0.1 * w).requires_grad_() if weight else None
    assert explain("rmsnorm", x.requires_grad_(), w, eps=1e-5, offset=offset).path == "kernel"
    ins = (x, w) if weight else (x,)
    outs, grads = run_with_grads(lambda a, b=None: nk.rmsnorm(a, b, 1e-5, offset), ins)
    ref_outs, ref_grads = run_with_grads(lambda a, b=None: reference(a, b, 1e-5, offset), as64(ins), grad_dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert outs[0].dtype == dtype and rel_err(outs[0], ref_outs[0]) < tol
    assert len(grads) == len(ins) and all(rel_err(g, r) < tol for g, r in zip(grads, ref_grads))


def test_gemma_cast_order_rounds_once_at_the_end(switches, gen):
    """In bfloat16 the kernel computes ``x * rstd * (1 + w)`` in float32 and rounds the product once, as Gemma's
    RMSNorm does (``(norm(x.float()) * (1 + w.float())).type_as(x)``), not the norm before the weight (Llama)."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    x, w = _inputs((64, 256), gen, torch.bfloat16)
    w = 0.1 * w
    gemma = (reference(x.float(), None, 1e-6) * (1.0 + w.float())).type_as(x)
    llama = reference(x.float(), None, 1e-6).type_as(x) * (1.0 + w)
    got = nk.rmsnorm(x, w, 1e-6, offset=1.0)
    assert (got != gemma).float().mean() < 0.01 < (got != llama).float().mean()


def test_an_offset_without_a_weight_is_refused(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    exp = explain("rmsnorm", torch.randn(4, 8), None, offset=1.0)
    assert exp.path == "compiler" and "an offset without a weight" in exp.reason
    with pytest.raises(ValueError, match="offset=1.0 needs a weight"):
        nk.rmsnorm(torch.randn(4, 8), None, offset=1.0)
