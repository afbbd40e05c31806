"""Scaled dot-product attention: ``F.scaled_dot_product_attention`` with grouped k/v heads (GQA), an optional
boolean or additive mask, or a causal mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import size


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple:
    """q, k, v of unit spread, and a mask like Hugging Face's padding masks: causal, with the last keys of some
    batches masked (boolean), or the same as an additive mask of 0 and -inf."""
    qs, ks, vs, ms = key.inputs
    q, k, v = (torch.randn(s.shape, generator=gen, dtype=getattr(torch, s.dtype)) for s in (qs, ks, vs))
    if ms is None:
        return q, k, v, None
    b, _, n, m = ms.shape
    keep = torch.ones(n, m, dtype=torch.bool).tril(m - n) if n <= m else torch.ones(n, m, dtype=torch.bool)
    lengths = torch.randint(max(1, m // 2), m + 1, (b, 1, 1, 1), generator=gen)
    allowed = keep & (torch.arange(m) < lengths)
    allowed = allowed.expand(ms.shape).clone()
    if ms.dtype == "bool":
        return q, k, v, allowed
    zero = torch.zeros((), dtype=getattr(torch, ms.dtype))
    return q, k, v, zero.masked_fill(~allowed, float("-inf")).expand(ms.shape).clone()


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, and each query row's log-sum-exp (float32), which the backward reads."""
    q, _, v, _ = tensors
    b, h, n, _ = q.shape
    return q.new_empty((b, h, n, v.shape[-1])), q.new_empty((b, h, n), dtype=torch.float32)


def shape_problem(specs, attrs: dict) -> str | None:
    """What every impl declines alike: ranks other than 4, heads that do not group, masks that do not broadcast
    to [b, h, sq, sk], a mask with causal (an error of the expression), a mask that needs a gradient."""
    q, k, v, mask = specs
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        return "ranks other than 4 (supports q, k, v [batch, heads, seq, dim])"
    b, h, n, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or k.shape[3] != d:
        return f"shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if k.shape[1] == 0 or h % k.shape[1]:
        return f"{h} query heads over {k.shape[1]} key/value heads (supports whole groups)"
    if mask is not None:
        full = (b, h, n, k.shape[2])
        if len(mask.shape) != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full)):
            return f"mask {list(mask.shape)} (supports 4-D masks broadcasting to {list(full)})"
        if attrs["causal"]:
            return "a mask with causal=True (the expression refuses it)"
        if mask.requires_grad:
            return "a mask that needs a gradient"
        if mask.dtype != "bool" and mask.dtype != q.dtype:
            return f"an additive mask of dtype {mask.dtype} for {q.dtype} queries"
    return None


def draw(rng, dtype: str) -> tuple:
    b, (hq, hk), n, m = rng.randint(1, 2), rng.choice([(2, 2), (2, 1), (4, 2)]), size(rng, 80), size(rng, 80) or 1
    d, dv = rng.choice([8, 16, 32]), rng.choice([8, 16])
    mask = rng.choice([None, None, "bool"])  # an additive mask needing a gradient is declined
    attrs = {"causal": mask is None and rng.random() < 0.5, "scale": rng.choice([None, 0.3])}
    return (((b, hq, n, d), dtype), ((b, hk, m, d), dtype), ((b, hk, m, dv), dtype),
            None if mask is None else ((b, 1, n, m), mask)), attrs

BENCHMARKS = (
    ((((1, 8, 512, 64), "float32"), ((1, 8, 512, 64), "float32"), ((1, 8, 512, 64), "float32"), None),
     {"causal": True}, {}),
)
"""A causal training call site for ``benchmarks/test_pack.py`` (``benchmarks/test_attention.py`` has more)."""

ATTENTION = register_op(Op(
    name="attention", reference=reference, tensors=("q", "k", "v", "mask"), optional=("mask",),
    attrs={"causal": bool, "scale": float | None}, defaults={"causal": False, "scale": None},
    differentiable=("q", "k", "v", "mask"), make_inputs=make_inputs,
    waives={"special input values": "PyTorch's CPU attention is not consistent about nan: a query row whose every "
            "score is nan gives 0 (as a fully masked row), one with some nan scores nan; the kernels spread nan in "
            "both. tests/test_attention.py checks nan and inf where PyTorch's attention is consistent",
            "special output gradients": "the backward takes the scores' gradient from rowsum(dO * O), as flash "
            "attention does, the expression from the softmax's own backward: an infinite output gradient meets "
            "inf - inf in other places"}, draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 1, 1, 8), "float32"), ((1, 1, 1, 8), "float32"), ((1, 1, 1, 8), "float32"), None), {}),
        ((((2, 4, 19, 16), "float32"), ((2, 2, 19, 16), "float32"), ((2, 2, 19, 16), "float32"), None),
         {"causal": True}),
        ((((2, 2, 33, 8), "float32"), ((2, 1, 40, 8), "float32"), ((2, 1, 40, 8), "float32"),
          ((2, 1, 33, 40), "bool")), {"scale": 0.3}),
        ((((1, 2, 17, 16), "bfloat16"), ((1, 2, 17, 16), "bfloat16"), ((1, 2, 17, 16), "bfloat16"),
          ((1, 1, 17, 17), "bfloat16")), {}),
    ),
))
