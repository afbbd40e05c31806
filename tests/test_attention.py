"""Attention: the numba impl against float64 SDPA (GQA, boolean and additive masks, fully masked rows, causal,
custom scale, bfloat16, empty and one-element inputs, Hugging Face's transposed views), and under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import nki_autotune.kernels as nk
from nki_autotune.kernels.attention.op import ATTENTION
from nki_autotune.registry import explain

from .helpers import rel_err
from .test_compile import Graphs, targets

IMPL = ATTENTION.impls["cpu_flash"]


def sdpa(q, k, v, mask=None, causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


def _qkv(gen, b, hq, hk, n, m, d, dv=None, dtype=torch.float32):
    q = torch.randn(b, hq, n, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hk, m, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hk, m, dv or d, generator=gen, dtype=dtype)
    return q, k, v


def _grads(fn, q, k, v, mask, gen, **kw):
    """fn's output and the gradients of q, k, v (leaves in the given layouts) of a random projection of it."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, mask, **kw)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * g).sum().backward()
    return out, [t.grad for t in leaves]


def _check(q, k, v, mask=None, tol=1e-5, gen=None, **kw):
    """nk.attention (the kernel) against SDPA in float64: output and every gradient within ``tol``."""
    seed = int(torch.randint(0, 2**30, (), generator=gen))
    assert explain("attention", q.requires_grad_(), k, v, mask, **kw).path == "kernel"
    out, grads = _grads(nk.attention, q, k, v, mask, torch.Generator().manual_seed(seed), **kw)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref, ref_grads = _grads(sdpa, q.double(), k.double(), v.double(), m64, torch.Generator().manual_seed(seed), **kw)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tol
    for g, r, t in zip(grads, ref_grads, (q, k, v)):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert rel_err(g, r) < tol
    return out, grads


def _padding(gen, b, n, m, causal=True):
    """Hugging Face's boolean mask [b, 1, n, m]: causal (bottom-right aligned) and the last keys of rows padded."""
    keep = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    lengths = torch.randint(max(1, m // 2), m + 1, (b, 1, 1, 1), generator=gen)
    return (keep if causal else torch.ones_like(keep)) & (torch.arange(m) < lengths)


CASES = {  # (b, hq, hk, n, m, d, dv), mask, causal, scale
    "gqa-causal": ((2, 4, 2, 37, 37, 16, 16), None, True, None),
    "mha-plain": ((1, 3, 3, 20, 29, 8, 8), None, False, None),
    "more-queries-than-keys-causal": ((1, 2, 1, 70, 33, 16, 16), None, True, None),
    "bool-padding-gqa": ((2, 4, 1, 65, 65, 32, 32), "bool", False, None),
    "additive-per-head": ((2, 2, 2, 40, 150, 16, 8), "additive", False, 0.2),
    "bool-several-tiles": ((1, 2, 2, 200, 300, 16, 16), "bool", False, None),
    "custom-scale-causal": ((2, 2, 1, 33, 33, 8, 8), None, True, 1.7),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_sdpa(switches, gen, case):
    switches(NKI_AUTOTUNE_KERNELS="on")
    (b, hq, hk, n, m, d, dv), kind, causal, scale = CASES[case]
    q, k, v = _qkv(gen, b, hq, hk, n, m, d, dv)
    mask = None
    if kind == "bool":
        mask = _padding(gen, b, n, m)
    elif kind == "additive":
        mask = torch.randn(b, hq, n, m, generator=gen).masked_fill(torch.rand(b, hq, n, m, generator=gen) < 0.3,
                                                                    float("-inf"))
    _check(q, k, v, mask, gen=gen, causal=causal, scale=scale)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_give_what_sdpa_gives(switches, gen, kind):
    """A query row whose keys are all masked: SDPA (torch 2.5 and later, CPU math and flash) gives 0 and gradients
    0; the kernel gives the same, and the other rows stay exact."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    q, k, v = _qkv(gen, 2, 2, 1, 40, 70, 16)
    allowed = torch.rand(2, 1, 40, 70, generator=gen) < 0.5
    allowed[0, 0, 3] = False
    allowed[1, 0, 17:40] = False  # the last rows of a batch, past the tile of 32 too
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out, (dq, _, _) = _check(q, k, v, mask, gen=gen)
    ref = sdpa(q, k, v, mask)
    assert (ref[0, :, 3] == 0).all() and (out[0, :, 3] == 0).all() and (out[1, :, 17:] == 0).all()
    assert (dq[0, :, 3] == 0).all() and (dq[1, :, 17:] == 0).all()


def test_bfloat16_within_its_tolerance(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    q, k, v = _qkv(gen, 2, 4, 2, 50, 50, 32, dtype=torch.bfloat16)
    _check(q, k, v, None, tol=1e-2, gen=gen, causal=True)


def test_hugging_face_transposed_views_are_read_in_place(switches, gen):
    """Hugging Face passes q, k, v as ``x.view(b, s, h, d).transpose(1, 2)`` with a boolean padding mask."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    b, n, hq, hk, d = 2, 45, 4, 2, 16
    q = torch.randn(b, n, hq, d, generator=gen).transpose(1, 2)
    k = torch.randn(b, n, hk, d, generator=gen).transpose(1, 2)
    v = torch.randn(b, n, hk, d, generator=gen).transpose(1, 2)
    _check(q, k, v, _padding(gen, b, n, n), gen=gen)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 4), (2, 2, 1, 0, 5, 8), (1, 2, 2, 3, 0, 8), (0, 2, 1, 4, 4, 8)],
                         ids=["one", "no-queries", "no-keys", "no-batch"])
def test_empty_and_one_element_inputs_give_what_sdpa_gives(switches, gen, shape):
    switches(NKI_AUTOTUNE_KERNELS="on")
    b, hq, hk, n, m, d = shape
    q, k, v = _qkv(gen, b, hq, hk, n, m, d)
    got, got_grads = _grads(nk.attention, q, k, v, None, torch.Generator().manual_seed(0))
    ref, ref_grads = _grads(sdpa, q, k, v, None, torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, ref, equal_nan=True)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, equal_nan=True)


@pytest.mark.parametrize("config", [{"threads": 2, "block_q": 32, "block_k": 64},
                                    {"threads": 2, "block_q": 256, "block_k": 512}], ids=["small", "large"])
def test_tile_sizes_give_the_same_result(gen, config):
    """Several tiles of queries and keys, with a remainder of each, or one tile of each."""
    q, k, v = _qkv(gen, 1, 2, 1, 100, 130, 16)
    mask = _padding(gen, 1, 100, 130)
    cfg = tuple(config[p] for p in IMPL.space)
    seed = int(torch.randint(0, 2**30, (), generator=gen))
    out, grads = _grads(lambda *a: IMPL.fwd_op(*a, False, None, *cfg)[0], q, k, v, mask,
                        torch.Generator().manual_seed(seed))
    ref, ref_grads = _grads(sdpa, q.double(), k.double(), v.double(), mask, torch.Generator().manual_seed(seed))
    assert rel_err(out, ref) < 1e-5 and all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


def test_declines_what_it_does_not_take(switches, gen):
    switches(NKI_AUTOTUNE_KERNELS="on")
    q, k, v = _qkv(gen, 1, 2, 1, 4, 4, 8)
    mask = torch.zeros(1, 1, 4, 4, requires_grad=True)
    assert "gradient" in explain("attention", q, k, v, mask).reason  # SDPA differentiates an additive mask
    assert "causal" in explain("attention", q, k, v, mask.detach(), causal=True).reason
    assert "groups" in explain("attention", q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8)).reason
    out = nk.attention(q, k, v, mask)  # the expression's path: the mask's gradient is there
    out.sum().backward()
    assert mask.grad is not None


@pytest.fixture
def fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_with_no_graph_break_and_no_recompile(switches, gen, fresh):
    switches(NKI_AUTOTUNE_KERNELS="on")
    graphs = Graphs()

    def block(q, k, v, mask):
        return nk.attention(q, k, v, mask).square().sum() + nk.attention(q, k, v, causal=True, scale=0.5).sum()

    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
    mask = _padding(gen, 2, 24, 24)
    for _ in range(3):
        q, k, v = (t.requires_grad_() for t in _qkv(gen, 2, 4, 2, 24, 24, 8))
        loss = fn(q, k, v, mask)
        loss.backward()
    assert counters["graph_break"] == {} and len(graphs.dynamo) == 1 and len(graphs.backward) == 1
    fwd = [n for n in targets(graphs.forward[0]) if "attention_cpu_flash" in n]
    assert fwd and any("attention_cpu_flash" in n for n in targets(graphs.backward[0]))
    ref = sdpa(q.double(), k.double(), v.double(), mask).square().sum() + sdpa(
        q.double(), k.double(), v.double(), causal=True, scale=0.5).sum()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool-mask"])
def test_opcheck(gen, masked):
    q, k, v = (t.requires_grad_() for t in _qkv(gen, 1, 2, 1, 5, 7, 8))
    mask = _padding(gen, 1, 5, 7) if masked else None
    cfg = IMPL.config_values(IMPL.default)
    torch.library.opcheck(IMPL.fwd_op, (q, k, v, mask, not masked, None, *cfg))
