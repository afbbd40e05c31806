"""Mixture-of-experts experts (``nk.moe_experts``): the kernels on the routings real routers give (skewed, experts
no token reaches, a token naming one expert twice, the no-expert index E), and the MoE families patched, compiled
in one graph and trained against transformers' own experts."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import nki_autotune.kernels as nk  # noqa: E402
from nki_autotune.autotune.inputs import load_samples  # noqa: E402
from nki_autotune.kernels import hf  # noqa: E402
from nki_autotune.kernels.moe_experts.op import make_inputs, make_routing, reference  # noqa: E402
from nki_autotune.registry import get_op, load_profile, ops, record  # noqa: E402

from .helpers import rel_err  # noqa: E402
from .parallel import SEED  # noqa: E402
from .test_compile import Graphs, fresh, targets  # noqa: E402, F401  (fresh: dynamo reset around each test)

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=8,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2, eos_token_id=1)),
}
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)


def routing(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Zipf-skewed distinct experts (exponent 2) among all but the last two (which get no token), then a token
    naming one expert twice (its neighbour's slot), and two slots of the no-expert index E."""
    idx = make_routing(t, k, e - 2, gen, skew=2.0)
    idx[1, 1] = idx[1, 0]
    idx[2, 0] = e
    idx[t - 1, k - 1] = e
    return idx


def _inputs(t, h, i, e, k, dtype, gen):
    x = torch.randn(t, h, generator=gen)
    w = torch.randn(t, k, generator=gen).softmax(-1)
    gu = torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5
    down = torch.randn(e, h, i, generator=gen) * i ** -0.5
    return [x.to(dtype), routing(t, k, e, gen), w.to(dtype), gu.to(dtype), down.to(dtype)]


def _grads(fn, inputs, dy):
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    out.backward(dy.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves if t.is_floating_point()]


@pytest.mark.parametrize("impl", ["cpu_grouped", "nki_blockwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(40, 16, 8, 9, 3), (70, 24, 12, 16, 4)], ids=["E9K3", "E16K4"])
def test_skewed_routing_with_idle_experts_repeats_and_no_expert_matches_float64(impl, dtype, shape, switches):
    t, h, i, e, k = shape
    gen = torch.Generator().manual_seed(SEED)
    inputs = _inputs(t, h, i, e, k, dtype, gen)
    counts = torch.bincount(inputs[1].reshape(-1), minlength=e + 1)
    assert (counts[:e] == 0).any() and counts[e] == 2  # idle experts, and two no-expert slots
    dy = torch.randn(t, h, generator=gen)
    want = _grads(lambda *a: reference(*a, "silu"), [x.double() if x.is_floating_point() else x for x in inputs],
                  dy.double())
    switches(NKI_AUTOTUNE_KERNEL_MOE_EXPERTS=impl)
    got = _grads(nk.moe_experts, inputs, dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, w in zip(("out", "hidden", "weights", "gate_up", "down"), got, want):
        assert g.dtype == dtype and rel_err(g, w) < tol, (name, rel_err(g, w))
    idle = (counts[:e] == 0).nonzero().flatten()
    assert not got[3][idle].any() and not got[4][idle].any()  # an expert no token reached has no gradient
    assert got[2][2, 0] == 0 and got[2][t - 1, k - 1] == 0  # nor a no-expert slot's weight


def build(family: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **extra)
    config._experts_implementation = "grouped_mm"
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY["vocab_size"], (3, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _run(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_patched_matches_unpatched_and_compiles_in_one_graph(family, switches):
    ref = build(family)
    model = copy.deepcopy(ref)
    assert hf.patch(model)["moe_experts"] == 2
    inputs = _batch(1)
    want = _run(ref, inputs)
    switches(NKI_AUTOTUNE_KERNELS="off")  # off: the experts' own forward (grouped_mm), bit for bit
    loss, grads = _run(model, inputs)
    assert torch.equal(loss, want[0]) and all(torch.equal(g, want[1][n]) for n, g in grads.items())
    switches(NKI_AUTOTUNE_KERNELS="on")
    loss, grads = _run(model, inputs)
    assert rel_err(loss, want[0]) < 1e-5
    for n, g in grads.items():
        assert rel_err(g, want[1][n]) < 1e-5, n
    graphs = Graphs()
    step = torch.compile(model, backend=graphs, fullgraph=True, dynamic=False)
    for seed in (2, 3):  # a second batch, other routing: no new graph
        step(**_batch(seed)).loss.backward()
    assert counters["graph_break"] == {}
    assert len(graphs.dynamo) == 1 and len(graphs.forward) == 1 and len(graphs.backward) == 1
    impl = get_op("moe_experts").impls["cpu_grouped"]
    fwd = [str(n.target) for n in graphs.forward[0].graph.nodes if n.op == "call_function"]
    assert fwd.count(str(impl.kernel_op)) == 2 and str(impl.bwd_op) in targets(graphs.backward[0])


def test_transformers_eager_experts_do_not_compile_in_one_graph():
    """What the op is for: the eager experts' loop over the experts hit has data-dependent shapes."""
    config_cls, model_cls, extra = FAMILIES["qwen3_moe"]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    config._experts_implementation = "eager"
    model = getattr(transformers, model_cls)(config)
    with pytest.raises(Exception, match="(?i)data.dependent|nonzero|graph break|Unsupported"):
        torch.compile(model, backend="eager", fullgraph=True)(**_batch(1))


def test_record_samples_keep_the_routing_the_tuner_times(tmp_path, switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    model = build("qwen3_moe")
    hf.patch(model)
    inputs = _batch(4)
    seen = []
    experts = model.model.layers[0].mlp.experts
    hook = experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    path = tmp_path / "profile.yaml"
    with record(path, samples=True):
        _run(model, inputs)
    hook.remove()
    profile = load_profile(path, ops())
    sites = [s for s in profile.sites if s.op == "moe_experts"]
    assert len(sites) == 2 and all(s.samples for s in sites)
    first = next(s for s in sites if s.site == "model.layers.0.mlp.experts")
    samples = load_samples(str(profile.samples_path(first)))
    assert torch.equal(samples["top_k_index"], seen[0])
    key = next(k for k, ss in profile.keys(ops()).items() if first in ss)
    made = make_inputs(key, torch.Generator().manual_seed(0), samples)
    assert torch.equal(made[1], seen[0])  # the tuner's inputs carry the recorded routing
    uniform = make_inputs(key, torch.Generator().manual_seed(0), None)[1]
    assert uniform.shape == seen[0].shape and not torch.equal(uniform, seen[0])


def test_without_samples_the_profile_keeps_the_skew_and_the_tuner_draws_it_and_says_so(tmp_path, switches):
    """A routing where one expert takes most tokens: the profile records its most and mean tokens per expert, the
    inputs the tuner times are drawn to match (not uniform), and the entry names where they came from."""
    from nki_autotune.autotune.tuner import Tuner, _inputs_note

    switches(NKI_AUTOTUNE_KERNELS="on")
    gen = torch.Generator().manual_seed(SEED)
    t, h, i, e, k = 256, 16, 8, 16, 2
    x, _, w, gu, down = _inputs(t, h, i, e, k, torch.float32, gen)
    idx = make_routing(t, k, e, gen, skew=2.5)
    path = tmp_path / "profile.yaml"
    with record(path):
        nk.moe_experts(x, idx, w, gu, down)
    profile = load_profile(path, ops())
    (site,) = profile.sites
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    assert site.samples is None
    assert site.summary == {"max_tokens_per_expert": int(counts.max()), "mean_tokens_per_expert": t * k / e}
    (key, sites), = profile.keys(ops()).items()
    tuner = Tuner.__new__(Tuner)
    tuner._summaries = None
    made = make_inputs(key, torch.Generator().manual_seed(0), load_samples(tuner._samples(sites, profile)))[1]
    busiest = int(torch.bincount(made.reshape(-1), minlength=e).max())
    uniform = int(torch.bincount(make_routing(t, k, e, torch.Generator().manual_seed(0)).reshape(-1)).max())
    assert abs(busiest - counts.max()) < abs(uniform - counts.max()) and busiest > 2 * uniform
    note = _inputs_note(sites, profile)
    assert note.startswith("no samples were kept") and f"max_tokens_per_expert {int(counts.max())}" in note
