"""Cross-entropy of a linear layer's logits, ``F.cross_entropy(F.linear(hidden, weight, bias), target)``, with
the logits optionally capped (``softcap``: ``cap * tanh(logits / cap)``, Gemma 2 and 3's
``final_logit_softcapping``) before the loss. hidden [N, H], weight [V, H], bias [V] or None, target [N] int64.
On the kernel path the [N, V] logits never exist: the kernels take the tokens in chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.loss import REDUCTIONS, cap_problem, capped


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
              ignore_index: int, reduction: str, softcap: float | None) -> torch.Tensor:
    logits = capped(F.linear(hidden, weight, bias), softcap)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, ignored: float = 0.05,
                **_) -> tuple[torch.Tensor | None, ...]:
    """Hidden states of unit spread, a weight of spread 1/sqrt(H) (logits of spread about 1, as a trained head
    gives), a small bias where the key has one, targets with a few ignored (padding) positions."""
    hs, ws, ts, bs = key.inputs
    dtype = getattr(torch, hs.dtype)
    hidden = torch.randn(hs.shape, generator=gen, dtype=dtype)
    weight = (torch.randn(ws.shape, generator=gen) / max(ws.shape[1], 1) ** 0.5).to(dtype)
    bias = None if bs is None else (0.1 * torch.randn(bs.shape, generator=gen)).to(dtype)
    if samples is not None and "target" in samples and tuple(samples["target"].shape) == tuple(ts.shape):
        return hidden, weight, samples["target"].clone(), bias
    target = torch.randint(0, max(ws.shape[0], 1), ts.shape, generator=gen)
    pad = torch.rand(ts.shape, generator=gen) < ignored
    pad.view(-1)[:1] = False  # at least one target counts: an all-ignored batch has no loss to compare
    return hidden, weight, target.masked_fill(pad, key.attr_dict["ignore_index"]), bias


def fake(tensors: tuple, attrs: dict, needs: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
    """The loss, then the gradients of hidden, weight and bias that the call needs (computed in the forward,
    scaled by the loss's gradient in the backward), an empty tensor for each one not needed."""
    hidden = tensors[0]
    return (hidden.new_empty(()), *(t.new_empty(t.shape) if need else hidden.new_empty(0)
                                    for t, need in zip((tensors[0], tensors[1], tensors[3]), needs)))


def shape_problem(specs, attrs: dict) -> str | None:
    h, w, t, b = specs
    if len(h.shape) != 2 or len(w.shape) != 2 or h.shape[1] != w.shape[1] or t.shape != h.shape[:1] or \
            (b is not None and tuple(b.shape) != tuple(w.shape[:1])):
        return (f"hidden {list(h.shape)}, weight {list(w.shape)}, target {list(t.shape)}"
                f"{'' if b is None else f', bias {list(b.shape)}'} (supports hidden [N, H], weight [V, H], "
                "target [N], bias [V])")
    if attrs["reduction"] not in REDUCTIONS:
        return f"reduction={attrs['reduction']!r} (supports {', '.join(map(repr, REDUCTIONS))})"
    return cap_problem(attrs["softcap"])


def draw(rng, dtype: str) -> tuple:
    n, h, v = size(rng, 150), size(rng, 64) or 1, size(rng, 700) + 1  # a hidden size of 0 is declined
    attrs = {"ignore_index": rng.choice([-100, 0, 3]), "reduction": rng.choice(REDUCTIONS),
             "softcap": rng.choice([None, None, 30.0])}
    bias = ((v,), dtype) if rng.random() < 0.3 else None
    return (((n, h), dtype), ((v, h), dtype), ((n,), "int64"), bias), attrs

BENCHMARKS = (
    ((((1024, 256), "float32"), ((32000, 256), "float32"), ((1024,), "int64"), None), {}, {}),
)
"""The demo model's head for ``benchmarks/test_pack.py`` (``benchmarks/test_linear_cross_entropy.py`` has more)."""

LINEAR_CROSS_ENTROPY = register_op(Op(
    name="linear_cross_entropy", reference=reference, tensors=("hidden", "weight", "target", "bias"),
    optional=("bias",), attrs={"ignore_index": int, "reduction": str, "softcap": float | None},
    defaults={"ignore_index": -100, "reduction": "mean", "softcap": None},
    differentiable=("hidden", "weight", "bias"), data_dependent=("target",), make_inputs=make_inputs, draw=draw,
    benchmarks=BENCHMARKS,
    waives={"special output gradients": "the gradients are computed in the forward and scaled by the loss's "
            "gradient in the backward: an infinite or nan loss gradient (a diverged step) gives inf where the "
            "expression's sums of infinities of both signs give nan"},
    examples=(
        ((((1, 3), "float32"), ((5, 3), "float32"), ((1,), "int64"), None), {}),
        ((((9, 16), "float32"), ((70, 16), "float32"), ((9,), "int64"), ((70,), "float32")), {"reduction": "sum"}),
        ((((37, 32), "float32"), ((1000, 32), "float32"), ((37,), "int64"), None), {"softcap": 3.0}),
        ((((130, 64), "float32"), ((700, 64), "float32"), ((130,), "int64"), None), {}),
    ),
))
