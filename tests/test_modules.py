"""``patch_modules``: the pack in a plain PyTorch model (a small hand-written Llama built from ``torch.nn``), patched
against an unpatched copy, eager and compiled; modules it does not match keep their forwards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import nki_autotune.kernels as nk
from nki_autotune.registry import get_op, scope

from .helpers import rel_err
from .test_compile import Graphs, fresh, targets  # noqa: F401  (fresh: dynamo reset around each test)

VOCAB, DIM, HEADS = 64, 32, 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


class Block(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM, eps=eps), nn.RMSNorm(DIM, eps=eps)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM)
        h = h + self.out(a)
        g, u = self.up(self.mlp_norm(h)).chunk(2, -1)
        return h + self.down(F.silu(g) * u)


class TinyLlama(nn.Module):
    """A Llama written by hand: a padded embedding, RMSNorms with eps given and not (nn.RMSNorm's default), a
    final norm without a weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.blocks = nn.ModuleList([Block(1e-5), Block(None)])
        self.norm = nn.RMSNorm(DIM, elementwise_affine=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def build(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def batch(seed: int, b: int = 3, s: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, s), generator=g)
    ids[1, :3] = 0  # padding
    labels = ids.roll(-1, 1).masked_fill(ids.roll(-1, 1) == 0, -100)
    labels[:, -1] = -100
    return ids, labels


def run(model, inputs):
    model.zero_grad(set_to_none=True)
    logits, loss = model(*inputs)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


SITES = {"rmsnorm": 5, "embedding": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_patched_matches_unpatched(dtype):
    ref = build(dtype=dtype)
    model = copy.deepcopy(ref)
    assert nk.patch_modules(model) == SITES
    inputs = batch(1)
    want = run(ref, inputs)
    for switch in ("off", "on"):
        with scope(NKI_AUTOTUNE_KERNELS=switch):
            logits, loss, grads = run(model, inputs)
        assert logits.dtype == dtype and rel_err(logits, want[0]) <= TOL[dtype], switch
        assert rel_err(loss, want[1]) <= TOL[dtype], switch
        for p, g in grads.items():
            assert rel_err(g, want[2][p]) <= TOL[dtype], f"{switch}: gradient of {p}"
        assert not grads["embed.weight"][0].any()  # padding_idx


def test_compiled_patched_model_has_one_graph_with_every_op_a_kernel(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    model = build()
    nk.patch_modules(model)
    graphs = Graphs()
    step = torch.compile(model, backend=graphs, fullgraph=True, dynamic=False)
    for seed in (3, 4):  # a second step at the same shape: no new graph
        step(*batch(seed))[1].backward()
    assert counters["graph_break"] == {}
    assert len(graphs.dynamo) == 1 and len(graphs.forward) == 1 and len(graphs.backward) == 1
    fwd = [str(n.target) for n in graphs.forward[0].graph.nodes if n.op == "call_function"]
    for op, n in SITES.items():
        impl = next(i for i in get_op(op).impls.values() if i.backend == "cpu")
        assert fwd.count(str(impl.kernel_op)) == n, op
        assert str(impl.bwd_op) in targets(graphs.backward[0]), op


def test_adamw_steps_follow_the_unpatched_run(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    losses = []
    for patched in (False, True):
        model = build(seed=5)
        if patched:
            nk.patch_modules(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses.append([])
        for _ in range(10):
            opt.zero_grad(set_to_none=True)
            loss = model(*batch(100))[1]
            loss.backward()
            opt.step()
            losses[-1].append(loss.item())
    assert losses[0][-1] < losses[0][0] - 0.5
    assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-4, list(zip(*losses))


def test_unpatch_restores_and_other_modules_keep_their_forwards(switches):
    switches(NKI_AUTOTUNE_KERNELS="on")
    model, ref = build(), build()
    model.extra = nn.ModuleList([nn.RMSNorm([4, DIM]), nn.Embedding(8, DIM, max_norm=1.0)])  # not matched
    state = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert nk.patch_modules(model) == SITES
    first = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert set(first) == {"embed", "norm", *(f"blocks.{i}.{k}_norm" for i in (0, 1) for k in ("attn", "mlp"))}
    assert nk.patch_modules(model) == SITES  # twice: nothing changes
    assert first == {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert nk.module_sites(copy.deepcopy(model)) == nk.module_sites(model)  # a copy is patched
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state
    nk.unpatch_modules(model)
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
    got, want = run(model, batch(6)), run(ref, batch(6))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_forward_set_by_someone_else_is_refused_before_anything_is_bound():
    model = build()
    model.norm.forward = lambda x: x
    with pytest.raises(ValueError, match="norm has its own forward.*rmsnorm=False"):
        nk.patch_modules(model)
    assert nk.module_sites(model) == {"rmsnorm": [], "embedding": []}
    assert nk.patch_modules(model, rmsnorm=False) == {"rmsnorm": 0, "embedding": 1}


def test_each_op_with_a_module_hook_is_a_keyword_and_any_other_is_refused():
    import inspect

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3))
    assert list(inspect.signature(nk.patch_modules).parameters)[1:] == list(nk.modules.OPS)
    with pytest.raises(TypeError, match="rmsnorms.*the ops it patches: embedding, rmsnorm"):
        nk.patch_modules(model, rmsnorms=False)
    assert "forward" not in model[0].__dict__  # refused: nothing bound
