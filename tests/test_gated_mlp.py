"""The gated MLP as one op (``nk.gated_mlp``): every config of the CPU kernel (tiles, each pass's library) against
float64, split and fused (Phi-3's ``gate_up``) weights, both activations; PyTorch's inf and nan where no product
overflows; a training call that keeps no [tokens, inter] tensor for its backward; the Hugging Face patch taking
whole MLPs, and giving them back to SwiGLU and the projections with ``gated_mlp=False``."""

from __future__ import annotations

import copy

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.kernels.gated_mlp import GATED_MLP
from nki_autotune.kernels.gated_mlp.op import reference
from nki_autotune.registry import Key, TensorSpec, explain

from .helpers import rel_err
from .parallel import SEED

IMPL = GATED_MLP.impls["cpu_tiled"]
KEPT = GATED_MLP.impls["cpu_kept"]


def _inputs(gen, rows, hidden, inter, out, fused, dtype=torch.float32, transposed=False):
    def weight(o, i):
        w = torch.randn(i, o, generator=gen).t() if transposed else torch.randn(o, i, generator=gen)
        return (w / i ** 0.5).to(dtype)

    x = torch.randn(*rows, hidden, generator=gen).to(dtype)
    gate = weight(2 * inter if fused else inter, hidden)
    return x, gate, None if fused else weight(inter, hidden), weight(out, inter)


def _key(tensors, act) -> Key:
    specs = tuple(None if t is None else TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                                    tuple(t.stride()), True) for t in tensors)
    return Key.of(GATED_MLP, specs, {"act": act})


def _kernel(tensors, act, config, dy, impl=IMPL):
    needs = tuple(t is not None for t in tensors)
    args = (needs,) if impl.forward_needs else ()
    results = impl.forward(tensors, {"act": act}, config, *args)
    grads = impl.backward((dy,), tensors, results, {"act": act}, config, needs)
    return [results[0], *(g for g in grads if g is not None)]


def _expression(tensors, act, dy, dtype=None):
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    y = reference(*leaves, act)
    y.backward(dy.to(y.dtype))
    return [y.detach(), *(t.grad for t in leaves if t is not None)]


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused-gate-up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", [IMPL, KEPT], ids=lambda i: i.name)
def test_every_config_matches_float64_forward_and_backward(impl, act, fused, dtype):
    """Each config's output and four gradients (three where gate and up are one weight) no further from float64
    than the expression in the same dtype (twice its error, or float32's floor): tiles that split the tokens
    unevenly, the products on either library, weights stored transposed; gate and up made again or kept."""
    gen = torch.Generator().manual_seed(SEED)
    tensors = _inputs(gen, (2, 75), 24, 40, 20, fused, dtype, transposed=not fused)
    dy = torch.randn(2, 75, 20, generator=gen).to(dtype)
    exact, same = _expression(tensors, act, dy, torch.float64), _expression(tensors, act, dy)
    configs = impl.configs(_key(tensors, act))
    assert {c["tile"] for c in configs} == {64, 128, 256}  # 150 tokens: one tile splits them, two hold them all
    for config in configs:
        for what, g, e, w in zip(("y", "dx", "dgate", "dup", "ddown"), _kernel(tensors, act, config, dy, impl),
                                 same, exact):
            assert g.dtype == e.dtype and g.shape == e.shape, (config, what)
            assert rel_err(g, w) <= max(2 * rel_err(e, w), 1e-5), (config, what, rel_err(g, w), rel_err(e, w))


def test_inf_and_nan_where_the_products_do_not_overflow_are_pytorchs():
    """A nan in x makes its token's output nan, an inf in the down weight its output column inf or nan, as the
    expression gives them, forward and backward."""
    gen = torch.Generator().manual_seed(SEED + 1)
    x, g, u, d = _inputs(gen, (9,), 16, 24, 12, fused=False)
    x[2, 5] = float("nan")
    d[3, 7] = float("inf")
    dy = torch.randn(9, 12, generator=gen)
    want = _expression((x, g, u, d), "silu", dy)
    for impl in (IMPL, KEPT):
        for config in impl.configs(_key((x, g, u, d), "silu")):
            for got, ref in zip(_kernel((x, g, u, d), "silu", config, dy, impl), want):
                for kind in (torch.isnan, torch.isposinf, torch.isneginf):
                    assert torch.equal(kind(got), kind(ref)), (impl.name, config, kind.__name__)


def test_empty_tokens_and_empty_intermediate():
    gen = torch.Generator().manual_seed(SEED + 2)
    for rows, inter in (((0, 3), 8), ((5,), 0)):
        tensors = _inputs(gen, rows, 6, inter, 7, fused=False)
        dy = torch.randn(*rows, 7, generator=gen)
        want = _expression(tensors, "silu", dy)
        for impl in (IMPL, KEPT):
            for got, ref in zip(_kernel(tensors, "silu", impl.default, dy, impl), want):
                assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("impl", ["cpu_tiled", "cpu_kept"])
def test_a_training_call_keeps_what_its_impl_says_for_the_backward(switches, impl):
    """The compiler's backward keeps gate and up for every token; ``cpu_tiled`` keeps x and the weights, making
    each tile's intermediate again, ``cpu_kept`` those and gate and up ([tokens, inter] each)."""
    switches(NKI_AUTOTUNE_KERNELS="on", NKI_AUTOTUNE_KERNEL_GATED_MLP=impl)
    gen = torch.Generator().manual_seed(SEED + 3)
    tensors = [t.requires_grad_() for t in _inputs(gen, (300,), 32, 96, 32, fused=False)]
    assert explain("gated_mlp", *tensors).impl == impl
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = nk.gated_mlp(*tensors)
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    others = sorted(tuple(t.shape) for t in saved if t.untyped_storage().data_ptr() not in inputs)
    assert saved and others == ([] if impl == "cpu_tiled" else [(300, 96), (300, 96)])
    y.sum().backward()
    want = _expression([t.detach() for t in tensors], "silu", torch.ones_like(y), torch.float64)
    for t, w in zip(tensors, want[1:]):
        assert rel_err(t.grad, w) <= 1e-5


def test_compiled_in_one_graph(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(SEED + 4)
    x, gu, _, d = (t.requires_grad_() if t is not None else None
                   for t in _inputs(gen, (4, 33), 16, 48, 16, fused=True))
    f = torch.compile(lambda x, gu, d: nk.gated_mlp(x, gu, None, d, act="gelu_pytorch_tanh"), fullgraph=True)
    y = f(x, gu, d)
    y.square().sum().backward()
    want = _expression((x.detach(), gu.detach(), None, d.detach()), "gelu_pytorch_tanh", 2 * y.detach(),
                       torch.float64)
    for got, w in zip((y.detach(), x.grad, gu.grad, d.grad), want):
        assert rel_err(got, w) <= 1e-5


def test_a_bad_call_says_what_is_taken():
    x, g, u, d = torch.randn(3, 8), torch.randn(10, 8), torch.randn(10, 8), torch.randn(8, 10)
    why = IMPL.supports(_key((x, g, u, d[:, :9]), "silu").inputs, {"act": "silu"})
    assert "down_weight [8, 9]" in why and "fused gate_up" in why
    assert "act 'relu' (supports 'silu', 'gelu_pytorch_tanh')" in IMPL.supports(_key((x, g, u, d), "relu").inputs,
                                                                               {"act": "relu"})


transformers = pytest.importorskip("transformers")


def _llama(**extra):
    torch.manual_seed(SEED % 1000)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=16, pad_token_id=0, **extra)
    return transformers.LlamaForCausalLM(config)


def test_the_patch_takes_whole_mlps_and_gives_them_back(switches):
    """Patched, each MLP is one gated_mlp call (its products not linear's, its activation not SwiGLU's) and the
    step is transformers'; ``gated_mlp=False`` gives SwiGLU and the products back; an MLP with biases stays
    SwiGLU's."""
    from nki_autotune.kernels import hf

    switches(NKI_AUTOTUNE_KERNELS="on")
    ref = _llama()
    model = copy.deepcopy(ref)
    counts = hf.patch(model)
    assert (counts["gated_mlp"], counts["swiglu"], counts["linear"]) == (2, 0, 8)
    assert hf.sites(model)["gated_mlp"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all("forward" not in m.__dict__ for n, m in model.named_modules() if ".mlp." in n)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(SEED))
    for m in (ref, model):
        m(input_ids=ids, labels=ids).loss.backward()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert rel_err(q.grad, p.grad) <= 1e-5, n
    counts = hf.patch(copy.deepcopy(ref), gated_mlp=False)
    assert (counts["gated_mlp"], counts["swiglu"], counts["linear"]) == (0, 2, 14)
    counts = hf.patch(_llama(mlp_bias=True))
    assert (counts["gated_mlp"], counts["swiglu"], counts["linear"]) == (0, 2, 14)
