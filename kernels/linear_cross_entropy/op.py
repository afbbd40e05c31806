"""Cross-entropy of a linear layer's logits, ``F.cross_entropy(F.linear(hidden, weight, bias), target, class_weight,
...)`` with PyTorch's options and Liger's (``shared.loss``), the logits optionally capped (``softcap``: ``cap *
tanh(logits / cap)``, Gemma 2 and 3's ``final_logit_softcapping``) before the loss. hidden [N, H], weight [V, H],
bias [V] or None, target [N] int64, class_weight [V] or None. Outputs: the loss, its z-loss term, the predicted
tokens. On the kernel path the [N, V] logits never exist: the kernels take the tokens in chunks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.loss import (
    CLASS_WEIGHTS,
    OPTION_TYPES,
    OPTIONS,
    draw_options,
    fake_extras,
    loss_reference,
    option_problem,
    targets,
)


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
              class_weight: torch.Tensor | None, ignore_index: int, reduction: str, softcap: float | None,
              label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
              predictions: bool = False) -> tuple[torch.Tensor, ...]:
    return loss_reference(F.linear(hidden, weight, bias), target, class_weight, ignore_index, reduction, softcap,
                          label_smoothing, lse_square_scale, predictions)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, ignored: float = 0.05,
                **_) -> tuple[torch.Tensor | None, ...]:
    """Hidden states of unit spread, a weight of spread 1/sqrt(H) (logits of spread about 1, as a trained head
    gives), a small bias where the key has one, targets with a few ignored (padding) positions, class weights in
    (0, 1) where the key has them."""
    hs, ws, ts, bs, cs = key.inputs
    dtype = getattr(torch, hs.dtype)
    hidden = torch.randn(hs.shape, generator=gen, dtype=dtype)
    weight = (torch.randn(ws.shape, generator=gen) / max(ws.shape[1], 1) ** 0.5).to(dtype)
    bias = None if bs is None else (0.1 * torch.randn(bs.shape, generator=gen)).to(dtype)
    cw = None if cs is None else torch.rand(cs.shape, generator=gen).to(getattr(torch, cs.dtype))
    if samples is not None and "target" in samples and tuple(samples["target"].shape) == tuple(ts.shape):
        return hidden, weight, samples["target"].clone(), bias, cw
    return hidden, weight, targets(gen, ts.shape, ws.shape[0], key.attr_dict["ignore_index"], ignored), bias, cw


def fake(tensors: tuple, attrs: dict, needs: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
    """The loss, its z-loss term, the predicted tokens, then the gradients of hidden, weight and bias that the
    call needs (computed in the forward, scaled by the loss's gradient in the backward), an empty tensor for each
    one not needed."""
    hidden = tensors[0]
    return (*fake_extras(hidden, attrs), *(t.new_empty(t.shape) if need else hidden.new_empty(0)
                                           for t, need in zip((tensors[0], tensors[1], tensors[3]), needs)))


def shape_problem(specs, attrs: dict) -> str | None:
    h, w, t, b, c = specs
    if len(h.shape) != 2 or len(w.shape) != 2 or h.shape[1] != w.shape[1] or t.shape != h.shape[:1] or \
            (b is not None and tuple(b.shape) != tuple(w.shape[:1])) or \
            (c is not None and tuple(c.shape) != tuple(w.shape[:1])):
        return (f"hidden {list(h.shape)}, weight {list(w.shape)}, target {list(t.shape)}"
                f"{'' if b is None else f', bias {list(b.shape)}'}"
                f"{'' if c is None else f', class weights {list(c.shape)}'} (supports hidden [N, H], weight [V, H], "
                "target [N], bias [V], class weights [V])")
    return option_problem(attrs)


def draw(rng, dtype: str) -> tuple:
    n, h, v = size(rng, 150), size(rng, 64) or 1, size(rng, 700) + 1  # a hidden size of 0 is declined
    # no "none": the draws are training calls, whose per-token gradients cpu_chunks declines (tested in inference in
    # tests/test_loss_options.py)
    attrs = {"ignore_index": rng.choice([-100, 0, 3]), "reduction": rng.choice(("mean", "sum")),
             "softcap": rng.choice([None, None, 30.0]), **draw_options(rng)}
    bias = ((v,), dtype) if rng.random() < 0.3 else None
    cw = ((v,), rng.choice([dtype, "float32"])) if rng.random() < 0.3 else None
    return (((n, h), dtype), ((v, h), dtype), ((n,), "int64"), bias, cw), attrs

BENCHMARKS = (
    ((((1024, 256), "float32"), ((32000, 256), "float32"), ((1024,), "int64"), None, None), {}, {}),
)
"""The demo model's head for ``benchmarks/test_pack.py`` (``benchmarks/test_linear_cross_entropy.py`` has more)."""

LINEAR_CROSS_ENTROPY = register_op(Op(
    name="linear_cross_entropy", reference=reference, tensors=("hidden", "weight", "target", "bias", "class_weight"),
    optional=("bias", "class_weight"),
    attrs={"ignore_index": int, "reduction": str, "softcap": float | None, **OPTION_TYPES},
    defaults={"ignore_index": -100, "reduction": "mean", "softcap": None, **OPTIONS},
    outputs=3, detached=(1, 2), differentiable=("hidden", "weight", "bias"), data_dependent=("target",),
    make_inputs=make_inputs, draw=draw,
    benchmarks=BENCHMARKS,
    waives={"special values in class_weight": CLASS_WEIGHTS,
            "special output gradients": "the gradients are computed in the forward and scaled by the loss's "
            "gradient in the backward: an infinite or nan loss gradient (a diverged step) gives inf where the "
            "expression's sums of infinities of both signs give nan"},
    examples=(
        ((((1, 3), "float32"), ((5, 3), "float32"), ((1,), "int64"), None, None), {}),
        ((((9, 16), "float32"), ((70, 16), "float32"), ((9,), "int64"), ((70,), "float32"), None),
         {"reduction": "sum"}),
        ((((37, 32), "float32"), ((1000, 32), "float32"), ((37,), "int64"), None, None), {"softcap": 3.0}),
        ((((130, 64), "float32"), ((700, 64), "float32"), ((130,), "int64"), None, None), {}),
        ((((47, 31), "float32"), ((123, 31), "float32"), ((47,), "int64"), ((123,), "float32"), ((123,), "float32")),
         {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0, "predictions": True}),
    ),
))
