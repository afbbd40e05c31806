"""The linear layer (``nk.linear``): every config of the CPU kernel (each pass on either library) against float64
and against PyTorch's inf and nan, weights stored either way round; the projections of a Hugging Face model routed
through it, labelled by module, and left alone with ``projections=False``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nki_autotune.kernels.linear import LINEAR
from nki_autotune.kernels.shared import products
from nki_autotune.kernels.shared.products import serves
from nki_autotune.registry import Key, TensorSpec, load_profile, ops, record

from .helpers import rel_err
from .parallel import SEED

IMPL = LINEAR.impls["cpu_products"]


def _inputs(gen, rows, n_in, n_out, transposed, bias, dtype=torch.float32):
    x = torch.randn(*rows, n_in, generator=gen)
    w = (torch.randn(n_in, n_out, generator=gen).t() if transposed else torch.randn(n_out, n_in, generator=gen))
    b = torch.randn(n_out, generator=gen) if bias else None
    return x.to(dtype), (w / n_in ** 0.5).to(dtype), None if b is None else b.to(dtype)


def _key(tensors) -> Key:
    specs = tuple(None if t is None else TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                                    tuple(t.stride()), True) for t in tensors)
    return Key.of(LINEAR, specs, {})


def _kernel(tensors, config, dy):
    (y,) = IMPL.forward(tensors, {}, config)
    grads = IMPL.backward((dy,), tensors, (y,), {}, config, (True, True, tensors[2] is not None))
    return [y, *(g for g in grads if g is not None)]


def _expression(tensors, dy):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    y = F.linear(*leaves)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves if t is not None)]


def test_a_dtype_onednn_does_not_run_here_is_offered_no_onednn_config_and_runs_torchs(monkeypatch):
    """A CPU without AVX-512 has no oneDNN bfloat16 linear ("could not create a primitive descriptor"): the tuner is
    not offered oneDNN for it, and a config that asks for it anyway (a default, a table from another machine) runs
    torch's product."""
    monkeypatch.setattr(products, "serves", lambda dtype: False)

    def refuses(*args):  # what oneDNN does with such a dtype
        raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation")

    monkeypatch.setattr(products, "linear", refuses)
    gen = torch.Generator().manual_seed(SEED)
    tensors = _inputs(gen, (29,), 40, 24, False, bias=True)
    dy = torch.randn(29, 24, generator=gen)
    assert {(c["fwd"], c["dgrad"], c["wgrad"]) for c in IMPL.configs(_key(tensors))} == {(0, 0, 0)}
    onednn = {**IMPL.default, "fwd": 1, "dgrad": 1, "wgrad": 1}
    want = _kernel(tensors, {**onednn, "fwd": 0, "dgrad": 0, "wgrad": 0}, dy)
    for g, w in zip(_kernel(tensors, onednn, dy), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "stored-transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_config_matches_float64_forward_and_backward(transposed, dtype):
    gen = torch.Generator().manual_seed(SEED)
    tensors = _inputs(gen, (3, 41), 72, 136, transposed, bias=True, dtype=dtype)
    dy = torch.randn(3, 41, 136, generator=gen).to(dtype)
    want = _expression([t.double() for t in tensors], dy.double())
    expr = _expression(tensors, dy)
    configs = IMPL.configs(_key(tensors))
    # each pass on either library, where oneDNN runs the dtype on this CPU
    assert len({(c["fwd"], c["dgrad"], c["wgrad"]) for c in configs}) == (8 if serves(dtype) else 1)
    for config in configs:
        got = _kernel(tensors, config, dy)
        for g, w, e, what in zip(got, want, expr, ("y", "dx", "dw", "db")):
            assert g.dtype == dtype and g.shape == w.shape, (config, what)
            # no worse than the expression's own rounding (twice it, or float32's floor)
            bound = max(2 * rel_err(e, w), 1e-5)
            assert rel_err(g, w) <= bound, (config, what, rel_err(g, w), bound)


def test_inf_and_nan_where_the_products_do_not_overflow_are_pytorchs():
    """A nan in x makes its row nan; an inf in the weight makes its column inf of the sign of x's entries (nan
    where one is 0 or the signs meet), in each pass on either library."""
    gen = torch.Generator().manual_seed(SEED + 1)
    x, w, b = _inputs(gen, (9,), 16, 12, transposed=False, bias=True)
    x[2, 5] = float("nan")
    x[4, 7] = 0.0
    w[3, 7] = float("inf")
    w[6, 0] = -float("inf")
    dy = torch.randn(9, 12, generator=gen)
    dy[1, 3] = float("inf")
    want = _expression((x, w, b), dy)
    for config in IMPL.configs(_key((x, w, b))):
        for g, r, what in zip(_kernel((x, w, b), config, dy), want, ("y", "dx", "dw", "db")):
            for kind in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(kind(g), kind(r)), (config, what, kind.__name__)
            fin = r.isfinite()
            assert torch.allclose(g[fin], r[fin], rtol=1e-4, atol=1e-5), (config, what)


def test_any_leading_dims_and_an_empty_contraction():
    gen = torch.Generator().manual_seed(SEED + 2)
    for rows, n_in in (((2, 3, 4), 8), ((5,), 0), ((0, 3), 6)):
        tensors = _inputs(gen, rows, n_in, 7, transposed=False, bias=n_in != 6)
        dy = torch.randn(*rows, 7, generator=gen)
        want = _expression(tensors, dy)
        for config in IMPL.configs(_key(tensors)):
            for g, r in zip(_kernel(tensors, config, dy), want):
                assert g.shape == r.shape and torch.allclose(g, r, atol=1e-5)


transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(SEED % 1000)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=16, pad_token_id=0, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def test_the_patch_routes_each_projection_and_the_recorder_labels_it_by_module(tmp_path, switches):
    from nki_autotune.kernels import hf

    switches(NKI_AUTOTUNE_KERNELS="on")
    plain = _llama()
    assert hf.patch(plain, projections=False)["linear"] == 0
    assert all(type(m).forward is type(m).forward and "forward" not in m.__dict__
               for m in plain.modules() if isinstance(m, torch.nn.Linear))
    model = _llama()
    assert hf.patch(model)["linear"] == 8  # q, k, v, o in each of two layers; the MLPs are gated_mlp's
    model = _llama()
    # q, k, v, o, gate, up, down in each of two layers; the head is the loss's
    assert hf.patch(model, gated_mlp=False)["linear"] == 14
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(SEED))
    ref = _llama()
    want = ref(input_ids=ids, labels=ids).loss
    path = tmp_path / "profile.yaml"
    with record(path):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    sites = {s.site: s for s in load_profile(path, ops()).sites if s.op == "linear"}
    assert {n.rsplit(".", 1)[-1] for n in sites} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"}
    assert len(sites) == 14
    shapes = {n: tuple(s.inputs[1].shape) for n, s in sites.items()}
    assert shapes["model.layers.0.mlp.down_proj"] == (32, 80) and shapes["model.layers.1.self_attn.k_proj"] == (16, 32)


@pytest.mark.parametrize("impl", ["cpu_products", "nki_tiled"])
def test_each_subset_of_gradients_reads_only_what_it_needs(impl):
    """The registry passes None for what ``reads`` leaves out: only the bias's gradient reads neither x nor the
    weight, x's reads the weight, the weight's reads x (the NKI kernel through the interpreter)."""
    kernel = LINEAR.impls[impl]
    gen = torch.Generator().manual_seed(SEED + 3)
    x, w, b = _inputs(gen, (2, 5), 12, 9, transposed=False, bias=True)
    dy = torch.randn(2, 5, 9, generator=gen)
    want = _expression((x, w, b), dy)[1:]
    for needs in ((False, False, True), (True, False, False), (False, True, False), (True, False, True)):
        reads = {n for n, need in zip(LINEAR.differentiable, needs) if need for n in kernel.reads[n]}
        given = tuple(t if name in reads else None for t, name in zip((x, w, b), LINEAR.tensors))
        got = kernel.backward((dy,), given, (None,), {}, kernel.default, needs)
        for g, r, need in zip(got, want, needs):
            assert (g is None) != need or (need and g.shape == r.shape and torch.allclose(g, r, atol=1e-5)), needs


def test_the_patch_takes_the_new_keywords_and_the_op_names():
    from nki_autotune.kernels import hf

    assert hf.patch(_llama(), projections=False, linear_cross_entropy=False)["linear"] == 0
    assert hf.patch(_llama(), linear=False)["linear"] == 0  # the op's name, as earlier releases took moe_experts=
    assert hf.patch(_llama(), experts=False)["linear"] == 8
    with pytest.raises(TypeError, match="projections"):
        hf.patch(_llama(), projection=False)
