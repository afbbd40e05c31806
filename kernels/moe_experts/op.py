"""The experts of a mixture-of-experts layer: each token's output is the sum over its K routed experts of
``weight * down(act(gate(x)) * up(x))`` (transformers 5's experts forward, ``Qwen3MoeExperts.forward``).

The reference is the dense form: every expert on every token, weighted by a [T, E] matrix that is zero off the
routing (a scatter of the top-k weights). It has no data-dependent shapes, so the fallback compiles in one graph
(``fullgraph=True``), and in float64 it is the oracle; it does E / K times the routed work, which is what a kernel
saves. An index equal to E (no expert, as an expert-parallel sentinel) lands in a dropped column: it adds nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.indices import sample_or

ACTS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
"""The gate's activations, by transformers' ``hidden_act`` names."""


def dense_weights(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int) -> torch.Tensor:
    """[T, E]: each token's routing weight per expert (summed where a token names one expert twice), 0 elsewhere."""
    t = top_k_index.shape[0]
    dense = top_k_weights.new_zeros(t, experts + 1).scatter_add(1, top_k_index, top_k_weights)
    return dense[:, :experts]


def reference(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str) -> torch.Tensor:
    t, h = hidden.shape
    e, i = down_proj.shape[0], down_proj.shape[2]
    dense = dense_weights(top_k_index, top_k_weights, e).to(hidden.dtype)
    gu = (hidden @ gate_up_proj.reshape(e * 2 * i, h).t()).view(t, e, 2 * i)
    gate, up = gu.chunk(2, dim=-1)
    a = ACTS[act](gate) * up * dense[..., None]
    return torch.einsum("tei,ehi->th", a, down_proj)


def shape_problem(specs, attrs: dict) -> str | None:
    """What every impl declines alike: shapes other than the experts' layout, an activation it does not know."""
    hidden, idx, w, gu, down = specs
    if attrs["act"] not in ACTS:
        return f"act={attrs['act']!r} (supports {', '.join(ACTS)})"
    if len(hidden.shape) != 2 or len(idx.shape) != 2 or tuple(w.shape) != tuple(idx.shape):
        return (f"hidden {list(hidden.shape)}, top_k_index {list(idx.shape)}, top_k_weights {list(w.shape)} "
                "(supports hidden [T, H] and both routing tensors [T, K])")
    t, h = hidden.shape
    if idx.shape[0] != t or len(gu.shape) != 3 or len(down.shape) != 3:
        return f"gate_up_proj {list(gu.shape)}, down_proj {list(down.shape)} for hidden [T={t}, H={h}]"
    e, i2, hh = gu.shape
    if hh != h or i2 % 2 or tuple(down.shape) != (e, h, i2 // 2):
        return (f"gate_up_proj {list(gu.shape)} and down_proj {list(down.shape)} (supports [E, 2I, H={h}] and "
                "[E, H, I])")
    if idx.shape[1] > e:
        return f"K={idx.shape[1]} experts per token of E={e} (supports K <= E)"
    if idx.dtype not in ("int64", "int32"):
        return f"top_k_index of {idx.dtype} (supports int64 or int32)"
    return None


def make_routing(t: int, k: int, e: int, gen: torch.Generator, skew: float = 0.0) -> torch.Tensor:
    """[T, K] distinct experts per token: uniform (``skew`` 0) or from a Zipf law of exponent ``skew`` over a
    shuffled ranking of the experts (a router's hot experts)."""
    if t == 0 or k == 0:
        return torch.zeros(t, k, dtype=torch.int64)
    probs = torch.arange(1, e + 1, dtype=torch.float64).pow(-skew)[torch.randperm(e, generator=gen)]
    return torch.multinomial(probs.expand(t, e), min(k, e), replacement=False, generator=gen)


def summary(tensors: dict, attrs: dict) -> dict[str, int | float]:
    """The routing's tokens per expert, most and mean (over the E experts): what sets the kernels' cost."""
    idx, experts = tensors["top_k_index"], tensors["gate_up_proj"].shape[0]
    flat = idx.detach().reshape(-1).cpu().long()
    counts = torch.bincount(flat[(flat >= 0) & (flat < experts)], minlength=experts)[:experts]
    return {"max_tokens_per_expert": int(counts.max()) if experts else 0,
            "mean_tokens_per_expert": round(float(counts.float().mean()), 3) if experts else 0.0}


SKEWS = tuple(i / 4 for i in range(13))
"""The Zipf exponents a routing is drawn with to match a recorded most-tokens-per-expert."""


def matching_skew(t: int, k: int, e: int, most: float, gen: torch.Generator) -> float:
    """The exponent of ``SKEWS`` whose routing gives its busiest expert the nearest to ``most`` tokens."""
    def busiest(s):
        idx = make_routing(t, k, e, torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen))), s)
        return int(torch.bincount(idx.reshape(-1), minlength=e).max()) if idx.numel() else 0

    return min(SKEWS, key=lambda s: abs(busiest(s) - most))


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, skew: float = 0.0,
                **_) -> tuple[torch.Tensor, ...]:
    """The recorded routing where the profile kept it; else ``make_routing`` at the skew that matches the recorded
    summary's busiest expert (``summary``), or ``skew``: the kernels' cost depends on how many tokens each expert
    gets (best practice 7). Weights a softmax over each token's K, as routers give."""
    hidden, idx_spec, w_spec, gu, down = key.inputs
    t, k = idx_spec.shape
    e = gu.shape[0]
    idx = sample_or(samples, "top_k_index", idx_spec.shape)
    if idx is None:
        recorded = (samples or {}).get("summary")
        if recorded and "max_tokens_per_expert" in recorded and e and t and k:
            skew = matching_skew(t, k, e, recorded["max_tokens_per_expert"], gen)
        idx = make_routing(t, k, e, gen, skew)
    dt = getattr(torch, hidden.dtype)
    scale = hidden.shape[1] ** -0.5
    return (torch.randn(hidden.shape, generator=gen, dtype=dt),
            idx.to(getattr(torch, idx_spec.dtype)),
            torch.randn(w_spec.shape, generator=gen).softmax(-1).to(getattr(torch, w_spec.dtype)),
            (torch.randn(gu.shape, generator=gen) * scale).to(getattr(torch, gu.dtype)),
            (torch.randn(down.shape, generator=gen) * (down.shape[2] ** -0.5)).to(getattr(torch, down.dtype)))


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    hidden = tensors[0]
    return (hidden.new_empty(hidden.shape),)


def draw(rng, dtype: str) -> tuple:
    """Small layers: up to 9 experts, K of them or fewer per token."""
    t, h, i, e = size(rng, 96), size(rng, 48) or 1, size(rng, 40) or 1, rng.randint(1, 9)
    k = rng.randint(1, e)
    return (((t, h), dtype), ((t, k), "int64"), ((t, k), dtype), ((e, 2 * i, h), dtype), ((e, h, i), dtype)), {
        "act": rng.choice(list(ACTS))}


def _call(t, h, i, e, k, dtype="float32", **attrs):
    return (((t, h), dtype), ((t, k), "int64"), ((t, k), dtype), ((e, 2 * i, h), dtype), ((e, h, i), dtype)), attrs


BENCHMARKS = (
    (*_call(2048, 1024, 512, 32, 4), {}),
    (*_call(2048, 1024, 512, 32, 4), {"skew": 1.0}),
    (*_call(512, 2048, 768, 128, 8, "bfloat16"), {}),
)
"""A small MoE's site and Qwen3-30B-A3B's expert sizes, for ``benchmarks/test_pack.py``."""

MOE_EXPERTS = register_op(Op(
    name="moe_experts", reference=reference,
    tensors=("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj"),
    attrs={"act": str}, defaults={"act": "silu"},
    differentiable=("hidden", "top_k_weights", "gate_up_proj", "down_proj"), data_dependent=("top_k_index",),
    summary=summary,
    make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    waives={"bfloat16 within 1e-2": "the experts' products run in bfloat16, as transformers' do (float32 products "
                                    "would cost twice the time and a float32 copy of every expert's weights): "
                                    "held to twice the expression's own bfloat16 error instead",
            "special input values": "the dense expression weights every expert's output, 0 for experts a token is "
                                    "not routed to: an inf or nan in such an expert's weights gives nan there "
                                    "(0 * inf), where transformers' experts and the kernels never read them",
            "special output gradients": "the same: the dense expression's weight gradients multiply every "
                                        "expert's unrouted 0 by the output gradient (0 * inf is nan)"},
    examples=(
        _call(1, 3, 2, 1, 1),
        _call(37, 16, 8, 4, 2),
        _call(64, 32, 24, 8, 2, act="gelu_pytorch_tanh"),
        _call(48, 24, 16, 6, 3, "bfloat16"),
    ),
))
