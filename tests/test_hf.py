"""Hugging Face models patched with the pack (nki_autotune.kernels.hf): tiny random models of each family, patched
against unpatched copies, eager and compiled; the families it does not know keep their numerics exactly."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

import nki_autotune.kernels as nk  # noqa: E402
from nki_autotune.kernels import hf  # noqa: E402
from nki_autotune.kernels.cross_entropy.hooks import causal_lm_loss  # noqa: E402
from nki_autotune.registry import Entry, get_op, load_profile, ops, record, scope  # noqa: E402

from .helpers import rel_err  # noqa: E402
from .test_compile import Graphs, fresh, targets  # noqa: E402, F401  (fresh: dynamo reset around each test)

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {  # config class, model class, what the family adds to the tiny config
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),  # per-head q_norm / k_norm
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    # sliding windows shorter than the batch's sequences, capped attention and final logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "query_pre_attn_scalar": 8,
                                                              "sliding_window": 4, "final_logit_softcapping": 30.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused gate_up_proj and qkv_proj
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # post-norms; q/k norms across all heads, weight in float32
    "granite": ("GraniteConfig", "GraniteForCausalLM",  # multipliers away from 1, each where Granite applies it
                {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.5,
                 "attention_multiplier": 0.2}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),  # layer 1 is NoPE
}
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
_BOTH = {"rope": 2, "attention": 2, "cross_entropy": 1, "linear_cross_entropy": 1, "embedding": 1, "moe_experts": 0,
         "linear": 8, "gated_mlp": 2, "swiglu": 0, "geglu": 0}  # the gated MLPs whole, their products inside them
SITES = {"llama": {"rmsnorm": 5, **_BOTH},
         "qwen3": {"rmsnorm": 9, **_BOTH},
         "olmo2": {"rmsnorm": 9, **_BOTH},
         "smollm3": {"rmsnorm": 5, **_BOTH, "rope": 1},
         "granite": {"rmsnorm": 5, **_BOTH, "linear_cross_entropy": 0},  # scaled logits
         # Gemma 2 normalises before and after attention and the MLP; Gemma 3 also per head (q_norm, k_norm)
         "gemma": {"rmsnorm": 5, **_BOTH},
         "gemma2": {"rmsnorm": 9, **_BOTH},
         "gemma3_text": {"rmsnorm": 13, **_BOTH},
         "phi3": {"rmsnorm": 5, **_BOTH, "linear": 4}}  # fused qkv_proj
DECLINED = {"gemma2": {"attention": 2}}
"""Patched sites whose calls take the compiler path: Gemma 2 caps its attention scores (``attn_logit_softcapping``),
which its attention runs as transformers writes it. (Gemma 3's per-head q/k norms, on [batch, heads, seq, dim] views
of [batch, seq, heads, dim], run the kernel: it reads their rows in place.)"""
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, noise: float = 0.1,
          **extra) -> torch.nn.Module:
    """A tiny model of ``family`` with random weights: transformers' init moved by ``noise`` (norm weights not one)."""
    config_cls, model_cls, family_extra = FAMILIES.get(family, (None, None, {}))
    if config_cls is None:
        config_cls, model_cls = f"{family}Config", f"{family}LMHeadModel"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**TINY, **{**family_extra, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model.to(dtype)


def batch(seed: int, vocab: int = TINY["vocab_size"], b: int = 3, s: int = 12) -> dict[str, torch.Tensor]:
    """Token ids with left and right padding, its attention mask, and labels with -100 on padding and elsewhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, -4:] = 0
    ids = ids.masked_fill(mask == 0, TINY["pad_token_id"])
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run(model, inputs, **kwargs) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits (None where the patched head never makes them), loss and every parameter's gradient of one forward
    and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **kwargs)
    out.loss.backward()
    logits = None if out.logits is None else out.logits.detach()
    return logits, out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def table_for(model, inputs, tmp_path, write_table) -> str:
    """A table from a recording of ``model``: every other key takes the op's CPU kernel, the rest the compiler."""
    path = tmp_path / "profile.yaml"
    with record(path):
        run(model, inputs)
    entries = []
    for i, key in enumerate(load_profile(path, ops()).keys(ops())):
        impl = cpu_impl(key.op)
        entries.append(Entry(key, impl.name if i % 2 == 0 else None, impl.config_at(key) if i % 2 == 0 else {},
                             reason="test"))
    return write_table(entries)


def cpu_impl(op: str):
    return next(impl for impl in get_op(op).impls.values() if impl.backend == "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_unpatched(family, dtype, tmp_path, write_table):
    """Logits, loss and gradients against the unpatched model, kernels off, on and by a table.

    In bfloat16 the weights are transformers' init, and each parameter's gradient is held to what transformers'
    own bfloat16 model reaches: its norm weights' gradients are 1.4% from its float32 run (reductions of
    bfloat16 products), so the kernels, which compute in float32, differ from it by about as much. There the
    patched model must be no further from the float32 run than transformers' bfloat16 model is (or 1e-2), each
    parameter's gradient and all of them together (Gemma 3's thirteen norms and GELU-gated MLPs, which round their
    bfloat16 products at every step, put transformers' bfloat16 gradients 1.3% from the kernels' together)."""
    low = dtype != torch.float32
    ref = build(family, dtype=dtype, noise=0.0 if low else 0.1)
    model = copy.deepcopy(ref)
    counts = hf.patch(model)
    assert counts == SITES.get(family, SITES["llama"])
    inputs = batch(1)
    want = run(ref, inputs)
    exact = run(build(family, noise=0.0), inputs) if low else want  # the same weights in float32
    variants = {"off": {"NKI_AUTOTUNE_KERNELS": "off"}, "on": {"NKI_AUTOTUNE_KERNELS": "on"},
                "table": {"NKI_AUTOTUNE_TABLE": table_for(model, inputs, tmp_path, write_table)}}
    for name, env in variants.items():
        with scope(**env):
            logits, loss, grads = run(model, inputs)
            model.eval()
            with torch.no_grad():
                logits = model(**inputs).logits  # training with labels makes none: the head and loss are fused
            model.train()
        assert torch.isfinite(logits).all()
        if low:  # logits: no further from the float32 run than transformers' bfloat16 model is
            floor = max(TOL[dtype], rel_err(want[0], exact[0]))
            assert rel_err(logits, exact[0]) <= 1.5 * floor, name
        else:
            assert rel_err(logits, want[0]) <= TOL[dtype], name
        assert rel_err(loss, want[1]) <= TOL[dtype], name
        if low:  # all gradients together: no further from the float32 run than transformers' bfloat16 model is
            floor = max(TOL[dtype], rel_err(_flat(want[2]), _flat(exact[2])))
            assert rel_err(_flat(grads), _flat(exact[2])) <= 1.5 * floor, name
        else:
            assert rel_err(_flat(grads), _flat(want[2])) <= TOL[dtype], name
        for p, g in grads.items():
            if low:
                floor = max(TOL[dtype], rel_err(want[2][p], exact[2][p]))
                # 2x for one parameter: Gemma 3's per-head q/k norm weights have 8 elements, where a few bfloat16
                # roundings of the attention around them move the error by half its size
                assert rel_err(g, exact[2][p]) <= 2 * floor, f"{name}: gradient of {p}"
            else:
                assert rel_err(g, want[2][p]) <= TOL[dtype], f"{name}: gradient of {p}"
        if name == "off" and not low:  # the expressions transformers writes, bit for bit
            assert torch.equal(logits, want[0]) and torch.equal(loss, want[1])
    pad = model.get_input_embeddings().padding_idx
    assert not grads["model.embed_tokens.weight"][pad].any()  # padding_idx: no gradient reaches its row


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_fused_head_and_loss_match_unpatched_and_make_no_logits(tied, switches, tmp_path):
    """In training with labels the head and its loss are one linear_cross_entropy call: loss and every parameter's
    gradient as unpatched (tied embeddings, num_items_in_batch, shift_labels with logits_to_keep), no logits;
    eval mode and linear_cross_entropy=False keep the logits; the recorded profile names the fused site."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    ref = build("llama")
    if tied:  # one parameter for the embedding and the head
        ref.lm_head.weight = ref.model.embed_tokens.weight
    model = copy.deepcopy(ref)
    hf.patch(model)
    inputs = batch(11)
    shift = torch.randint(0, TINY["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(3))
    shift[1, 2] = -100
    for extra in ({}, {"num_items_in_batch": torch.tensor(23)}, {"logits_to_keep": 5, "shift_labels": shift}):
        logits, loss, grads = run(model, inputs, **extra)
        _, want_loss, want = run(ref, inputs, **extra)
        assert logits is None
        assert rel_err(loss, want_loss) <= 1e-5, extra
        assert grads.keys() == want.keys() and all(rel_err(g, want[p]) <= 1e-5 for p, g in grads.items()), extra
    model.eval(), ref.eval()
    out, want_out = model(**inputs), ref(**inputs)
    assert rel_err(out.logits, want_out.logits) <= 1e-5 and rel_err(out.loss, want_out.loss) <= 1e-5
    model.train()
    assert model(input_ids=inputs["input_ids"]).logits is not None  # no labels: the class's forward
    plain = copy.deepcopy(ref).train()
    assert hf.patch(plain, linear_cross_entropy=False)["linear_cross_entropy"] == 0
    assert plain(**inputs).logits is not None
    with record(tmp_path / "p.yaml"):
        run(model, inputs)
    sites = load_profile(tmp_path / "p.yaml", ops()).sites
    assert [(s.op, s.site) for s in sites if "cross_entropy" in s.op] == [("linear_cross_entropy", "LlamaForCausalLM")]
    hf.unpatch(model)
    assert "forward" not in model.__dict__ and run(model, inputs)[0] is not None


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for g in grads.values()])


def test_loss_keeps_shift_ignore_index_and_num_items_in_batch():
    """The loss the patch binds is transformers' ForCausalLMLoss: shift, ignore index, the sum over
    num_items_in_batch under gradient accumulation, given shift_labels."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 7, 11, generator=g)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, 2] = -100
    labels[1, 4] = 5
    cases = [(labels, {}), (labels, {"num_items_in_batch": torch.tensor(9)}), (labels, {"num_items_in_batch": 9}),
             (labels.masked_fill(labels == -100, 5), {"ignore_index": 5}),
             (labels, {"shift_labels": torch.randint(0, 11, (2, 7), generator=g)})]
    for env in ({"NKI_AUTOTUNE_KERNELS": "off"}, {"NKI_AUTOTUNE_KERNELS": "on"}):
        with scope(**env):
            for y, kw in cases:
                got_x = logits.clone().requires_grad_()
                want_x = logits.clone().requires_grad_()
                got = causal_lm_loss(got_x, y, 11, **kw)
                want = ForCausalLMLoss(want_x, y, 11, **kw)
                got.backward()
                want.backward()
                assert rel_err(got, want) <= 1e-6 and rel_err(got_x.grad, want_x.grad) <= 1e-5, (env, kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_patched_model_has_one_graph_with_every_op_a_kernel(family, switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    model = build(family)
    counts = hf.patch(model)
    graphs = Graphs()
    step = torch.compile(model, backend=graphs, fullgraph=True, dynamic=False)
    for seed in (3, 4):  # a second step at the same shape: no new graph
        out = step(**batch(seed))
        out.loss.backward()
    assert counters["graph_break"] == {}
    assert len(graphs.dynamo) == 1 and len(graphs.forward) == 1 and len(graphs.backward) == 1
    fwd = [str(n.target) for n in graphs.forward[0].graph.nodes if n.op == "call_function"]
    if counts["linear_cross_entropy"]:  # a training step with labels: the loss is the fused head's
        counts["cross_entropy"] = 0
    for op, n in counts.items():
        if not n:
            assert str(cpu_impl(op).kernel_op) not in fwd, op
            continue
        impl = cpu_impl(op)
        n -= DECLINED.get(family, {}).get(op, 0)
        assert fwd.count(str(impl.kernel_op)) == n, op
        # an impl whose gradients are all saved ones, scaled (Impl.scaled), calls no backward operator
        calls_backward = n > 0 and set(impl.scaled or ()) != set(impl.op.differentiable)
        assert (str(impl.bwd_op) in targets(graphs.backward[0])) == calls_backward, op


@pytest.mark.parametrize("family", FAMILIES)
def test_twenty_adamw_steps_follow_the_unpatched_run(family, switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    losses = []
    for patched in (False, True):
        model = build(family, seed=5)
        if patched:
            hf.patch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run_losses = []
        inputs = batch(100)  # one batch, learnt by heart: the loss falls fast
        for _ in range(20):
            opt.zero_grad(set_to_none=True)
            out = model(**inputs)
            out.loss.backward()
            opt.step()
            run_losses.append(out.loss.item())
        losses.append(run_losses)
    assert losses[0][-1] < losses[0][0] - 0.5  # it learns: the comparison is not of a flat line
    assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-4, list(zip(*losses))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_unpatch_restores_the_forwards_and_the_rotary_function(switches, family):
    modeling = hf.families.FAMILIES[family].modeling
    switches(NKI_AUTOTUNE_KERNELS="on")
    gc.collect()  # models other tests patched and dropped count as unpatched
    original, interface = modeling.apply_rotary_pos_emb, modeling.ALL_ATTENTION_FUNCTIONS
    assert original.__module__ == modeling.__name__ and not hasattr(original, "__wrapped__")
    ref, model, other = build(family), build(family), build(family)
    before = {n: p for n, p in model.named_parameters()}
    state = {k: (v.data_ptr(), v.dtype, v.device) for k, v in model.state_dict().items()}
    hf.patch(model)
    hf.patch(other)
    first = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert hf.patch(model) == SITES[family]  # a second patch changes nothing
    assert first == {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert {n: p for n, p in model.named_parameters()} == before
    assert {k: (v.data_ptr(), v.dtype, v.device) for k, v in model.state_dict().items()} == state
    assert modeling.apply_rotary_pos_emb is not original
    hf.unpatch(model)
    assert modeling.apply_rotary_pos_emb is not original  # `other` is still patched
    hf.unpatch(other)
    assert modeling.apply_rotary_pos_emb is original and modeling.ALL_ATTENTION_FUNCTIONS is interface
    dropped = build(family)
    hf.patch(dropped)
    assert modeling.apply_rotary_pos_emb is not original
    del dropped
    gc.collect()
    assert modeling.apply_rotary_pos_emb is original
    for m in (model, other):
        assert not [n for n, x in m.named_modules() if "forward" in x.__dict__ or "_loss_function" in x.__dict__]
        assert hf.sites(m) == {op: [] for op in hf.OPS}
    inputs = batch(6)
    got, want = run(model, inputs), run(ref, inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_restores_each_family(family, switches):
    """Every family: after ``unpatch`` no forward or loss is bound on any module, the modeling module's rotary
    function and attention registry are the originals, and the model computes what it computed, bit for bit."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    gc.collect()  # models other tests patched and dropped count as unpatched
    modeling = hf.families.FAMILIES[family].modeling
    names = ("apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS")
    originals = [getattr(modeling, n) for n in names]
    ref, model = build(family), build(family)
    inputs = batch(10)
    want = run(ref, inputs)
    hf.patch(model)
    hf.unpatch(model)
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__ or "_loss_function" in m.__dict__]
    assert [getattr(modeling, n) for n in names] == originals
    got = run(model, inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(g, want[2][p]) for p, g in got[2].items())


def test_site_labels_are_qualified_module_names(tmp_path):
    model = build("qwen3")
    hf.patch(model)
    path = tmp_path / "p.yaml"
    with record(path):
        run(model, batch(7))
        model.eval()  # the loss on the logits: the cross-entropy site
        model(**batch(7))
    recorded = {(s.op, s.site) for s in load_profile(path, ops()).sites}
    assert recorded == {(op, name) for op, names in hf.sites(model).items() for name in names}
    assert {("rmsnorm", "model.layers.0.input_layernorm"), ("rmsnorm", "model.layers.1.self_attn.k_norm"),
            ("rope", "model.layers.0.self_attn"), ("gated_mlp", "model.layers.1.mlp"),
            ("embedding", "model.embed_tokens"), ("cross_entropy", "Qwen3ForCausalLM"),
            ("linear_cross_entropy", "Qwen3ForCausalLM")} <= recorded


def test_other_families_are_refused_and_keep_their_numerics(switches):
    """A family nobody names (GPT-2: LayerNorm, GELU MLP, learned positions) is refused and left exactly as it
    was, and neither it nor an unpatched model of a patched family computes anything else while another model
    is patched."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    gpt2 = build("GPT2", n_inner=64)
    bystander = build("llama")
    inputs = batch(8)
    want_gpt2, want_llama = run(gpt2, inputs), run(bystander, inputs)
    forwards = {n: m.__dict__.get("forward") for n, m in gpt2.named_modules()}
    supported = ", ".join(hf.families.FAMILIES)
    with pytest.raises(hf.UnsupportedModel, match=f"'gpt2'.*supported families: {supported}$"):
        hf.patch(gpt2)
    assert forwards == {n: m.__dict__.get("forward") for n, m in gpt2.named_modules()}
    assert "_loss_function" not in gpt2.__dict__
    patched = build("llama")
    hf.patch(patched)
    for model, want in ((gpt2, want_gpt2), (bystander, want_llama)):
        got = run(model, inputs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(torch.equal(g, want[2][p]) for p, g in got[2].items())
    with pytest.raises(hf.UnsupportedModel, match="holds no Hugging Face model"):
        hf.patch(torch.nn.Linear(2, 2))
    hf.unpatch(patched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_halves_of_a_fused_gate_up_projection_run_the_kernel_in_place(dtype, switches):
    """Phi-3's MLP passes ``gate_up.chunk(2, -1)`` to ``nk.swiglu``: rows with a stride, which the CPU kernel
    reads where they are; its value and both gradients are the expression's."""
    from nki_autotune.registry import explain

    switches(NKI_AUTOTUNE_KERNELS="on")
    gate_up = torch.randn(3, 5, 2 * 24, dtype=dtype)
    dy = torch.randn(3, 5, 24, dtype=dtype)
    results = []
    for env in ("on", "off"):
        with scope(NKI_AUTOTUNE_KERNELS=env):
            x = gate_up.clone().requires_grad_()
            gate, up = x.chunk(2, dim=-1)
            assert not gate.is_contiguous()
            if env == "on":
                assert explain("swiglu", gate, up).impl == "cpu_fused", explain("swiglu", gate, up)
            y = nk.swiglu(gate, up)
            y.backward(dy)
            results.append((y.detach(), x.grad))
    (y, dx), (want_y, want_dx) = results
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the kernel computes bfloat16 in float32, rounding once
    assert rel_err(y, want_y) <= tol and rel_err(dx, want_dx) <= tol


def test_a_partial_or_absent_rotary_embedding_is_left_as_transformers_writes_it(switches):
    """Phi-3 with a partial rotary embedding (the first half of each head rotated) and SmolLM3's NoPE layer:
    their rotary embedding (or its absence) is what transformers writes, and ``patch`` does not count it."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    phi3 = build("phi3", partial_rotary_factor=0.5)
    ref = copy.deepcopy(phi3)
    counts = hf.patch(phi3)
    assert counts["rope"] == 0 and counts["attention"] == 2  # its attention function is still the pack's
    smol = build("smollm3")
    hf.patch(smol)
    assert hf.sites(smol)["rope"] == ["model.layers.0.self_attn"]
    assert hf.sites(smol)["attention"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    inputs = batch(9)
    got, want = run(phi3, inputs), run(ref, inputs)  # training with labels: no logits, the head and loss fused
    assert rel_err(got[1], want[1]) <= 1e-5 and rel_err(_flat(got[2]), _flat(want[2])) <= 1e-5
    for m in (phi3, smol):
        hf.unpatch(m)


def test_a_forward_set_by_someone_else_is_not_overwritten():
    model = build("llama")
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: x
    with pytest.raises(ValueError, match="model.layers.1.mlp has its own forward"):
        hf.patch(model)
    assert hf.sites(model) == {op: [] for op in hf.OPS}
    with pytest.raises(ValueError, match="model.layers.1.mlp has its own forward.*pass swiglu=False"):
        hf.patch(model, gated_mlp=False)
    counts = hf.patch(model, gated_mlp=False, swiglu=False)
    assert counts["swiglu"] == counts["gated_mlp"] == 0 and counts["linear"] == 14  # the MLPs' products too
    hf.unpatch(model)


def test_versions_outside_the_tested_range_are_refused_and_the_extra_pins_that_range():
    with pytest.raises(hf.UnsupportedVersion, match=r"transformers >=.*installed: 4\.40\.0.*nki-autotune\[hf\]"):
        hf.check_version("4.40.0")
    assert hf.check_version() == transformers.__version__
    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    pins = [line.split("=", 1)[0].strip() for line in extras.splitlines() if f'"transformers{hf.SUPPORTED}"' in line]
    assert sorted(pins) == ["dev", "hf"]


def test_code_transformers_moved_is_refused_not_patched_into_a_no_op(monkeypatch):
    import transformers.models.llama.modeling_llama as modeling

    class Attention(torch.nn.Module):
        def forward(self, q, k):
            return q, k

    with pytest.raises(RuntimeError, match="does not call .*apply_rotary_pos_emb.*rope=False"):
        hf.check_routable(modeling, Attention, "rope")
    model = build("llama")
    monkeypatch.setattr(modeling.LlamaForCausalLM, "forward", lambda self, **kw: kw)
    with pytest.raises(RuntimeError, match="through self.loss_function.*cross_entropy=False"):
        hf.patch(model)
    assert hf.sites(model) == {op: [] for op in hf.OPS}  # refused: nothing bound


def _from_checkout(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NKI_AUTOTUNE_")}
    env.pop("PYTHONPATH", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_checkout_kernels_folder_does_not_shadow_hugging_face_kernels(tmp_path):
    """From the checkout root (on sys.path as ''), ``kernels`` is this folder; transformers imports ``kernels``
    while it loads its modeling code (to see whether Hugging Face's kernels is installed)."""
    r = _from_checkout("""
        import sys
        assert sys.path[0] == ''
        from transformers import LlamaConfig, LlamaForCausalLM
        LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
        import kernels
        assert getattr(kernels, '__file__', None) is None, kernels   # absent: nothing but a namespace
        import nki_autotune.kernels as nk
        print(nk.rmsnorm.__module__)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "nki_autotune.kernels.rmsnorm"
    installed = tmp_path / "site" / "kernels"  # Hugging Face's kernels, installed elsewhere on sys.path
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("from .layer import Mode\n")
    (installed / "layer.py").write_text("class Mode:\n    pass\n")
    r = _from_checkout("""
        import kernels
        from kernels.layer import Mode
        import nki_autotune.kernels as nk
        print(kernels.__file__, kernels.Mode is Mode, nk.swiglu.__module__)
    """, {"PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(installed / "__init__.py"), "True", "nki_autotune.kernels.swiglu"]


def test_the_example_step_factory_is_reproducible(monkeypatch):
    """examples/train.py's make_step() (verify's STEP): two calls give the same weights and batches; the step
    returns the loss. Loaded as verify loads a STEP, its folder first on the path (its imports resolve as when it
    runs)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.BATCH, example.SEQ = 2, 64  # the protocol, at a smaller batch
    a, b = example.make_step(compile=False), example.make_step(compile=False)
    first = [a() for _ in range(2)]
    second = [b() for _ in range(2)]
    assert all(x.dim() == 0 and not x.requires_grad for x in first)
    assert torch.equal(torch.stack(first), torch.stack(second)) and torch.isfinite(first[0])


def test_recording_under_gradient_checkpointing_counts_the_recomputation_and_keeps_the_stack(tmp_path):
    """Checkpointing stops each layer's recomputation early with an exception: the recorder's module stack still
    unwinds, so steps stay calls of the model and a call after it is labelled where it is made."""
    model = build("llama")
    hf.patch(model, cross_entropy=False)
    model.train()
    # non-reentrant, as the docstring says: transformers 5's default (4.57's is reentrant)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24's name; the older one warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with record(tmp_path / "p.yaml"):
        for step in range(3):
            inputs = batch(step)
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            targets = inputs["labels"][:, 1:].reshape(-1)
            loss = nk.cross_entropy(logits[:, :-1].reshape(-1, TINY["vocab_size"]), targets)
            loss.backward()
    calls = {s.site: s.calls for s in load_profile(tmp_path / "p.yaml", ops()).sites}
    loose = [s for s in calls if "test_hf.py:" in s]
    assert len(loose) == 1 and calls[loose[0]] == 1, calls  # the loss, at its line: no module's name
    assert calls["model.embed_tokens"] == calls["model.norm"] == 1
    assert calls["model.layers.0.input_layernorm"] == calls["model.layers.1.mlp"] == 2  # forward and recomputation


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_patched_model_is_patched_and_routes_its_rotary_embedding(how, monkeypatch):
    """A deep copy, or a model saved whole and loaded, runs the pack as the original does, and keeps its own
    attention routed after the original is unpatched and collected."""
    import io

    from nki_autotune.kernels.rope import hooks as hf_rope

    model = build("llama")
    hf.patch(model)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert hf.sites(twin) == hf.sites(model)
    inputs = batch(3)
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        want = run(model, inputs)
        hf.unpatch(model)
        del model
        gc.collect()
        calls = []
        real = hf_rope.rope
        monkeypatch.setattr(hf_rope, "rope", lambda *a: calls.append(1) or real(*a))
        got = run(twin, inputs)
    assert len(calls) == 2  # both attentions of the copy
    assert torch.equal(got[1], want[1]) and all(torch.equal(got[2][n], want[2][n]) for n in want[2])


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_capped_logits_run_the_cross_entropy_kernel_without_the_fused_head(family, switches):
    """Gemma 2 and 3 patched with ``linear_cross_entropy=False``: the model caps its logits
    (``final_logit_softcapping``) and its loss runs nk.cross_entropy's kernel, forward and backward, in one compiled
    graph; loss and every parameter's gradient as the unpatched model's."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    ref = build(family)
    assert ref.config.final_logit_softcapping
    model = copy.deepcopy(ref)
    assert hf.patch(model, linear_cross_entropy=False)["cross_entropy"] == 1
    graphs = Graphs()
    step = torch.compile(model, backend=graphs, fullgraph=True, dynamic=False)
    inputs = batch(12)
    logits, loss, grads = run(step, inputs)
    want_logits, want_loss, want = run(ref, inputs)
    assert counters["graph_break"] == {} and len(graphs.forward) == 1 and len(graphs.backward) == 1
    impl = cpu_impl("cross_entropy")
    fwd = [str(n.target) for n in graphs.forward[0].graph.nodes if n.op == "call_function"]
    assert fwd.count(str(impl.kernel_op)) == 1
    assert str(impl.bwd_op) in targets(graphs.backward[0])
    assert rel_err(logits, want_logits) <= 1e-5 and rel_err(loss, want_loss) <= 1e-5
    assert len(grads) == len(want) and all(rel_err(g, w) <= 1e-5 for g, w in zip(grads.values(), want.values()))
