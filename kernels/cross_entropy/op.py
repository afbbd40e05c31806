"""Cross-entropy of logits [N, V] against int64 targets [N] with PyTorch's options (class ``weight`` [V],
``label_smoothing``, ``reduction`` mean/sum/none, ``ignore_index``), the logits optionally capped first
(``softcap``: ``cap * tanh(logits / cap)``, Gemma 2 and 3's ``final_logit_softcapping``), plus a z-loss
(``lse_square_scale``) and, where asked, each token's predicted class. Outputs: the loss, its z-loss term and the
predicted tokens (``shared.loss.loss_reference``)."""

from __future__ import annotations

import torch

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.loss import (
    CLASS_WEIGHTS,
    OPTION_TYPES,
    OPTIONS,
    REDUCTIONS,
    draw_options,
    fake_extras,
    loss_reference,
    option_problem,
    targets,
)


def reference(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
              reduction: str, softcap: float | None = None, label_smoothing: float = 0.0,
              lse_square_scale: float = 0.0, predictions: bool = False) -> tuple[torch.Tensor, ...]:
    return loss_reference(logits, target, weight, ignore_index, reduction, softcap, label_smoothing,
                          lse_square_scale, predictions)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, ignored: float = 0.05,
                **_) -> tuple[torch.Tensor, ...]:
    """Logits of a half-trained model (spread about 2), targets with a few ignored (padding) positions, class
    weights in (0, 1) where the key has them."""
    ls, ts, ws = key.inputs[0].shape, key.inputs[1].shape, key.inputs[2]
    logits = 2.0 * torch.randn(ls, generator=gen, dtype=getattr(torch, key.inputs[0].dtype))
    weight = None if ws is None else torch.rand(ws.shape, generator=gen).to(getattr(torch, ws.dtype))
    if samples is not None and "target" in samples and tuple(samples["target"].shape) == tuple(ts):
        return logits, samples["target"].clone(), weight
    return logits, targets(gen, ts, ls[-1], key.attr_dict["ignore_index"], ignored), weight


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, ...]:
    """The loss, its z-loss term, the predicted tokens, and the per-row log-sum-exp every impl keeps for its
    backward."""
    x = tensors[0]
    return (*fake_extras(x, attrs), x.new_empty(x.shape[:1], dtype=torch.float32))


def shape_problem(specs, attrs: dict) -> str | None:
    x, t, w = specs
    if len(x.shape) != 2 or len(t.shape) != 1 or t.shape[0] != x.shape[0] or \
            (w is not None and tuple(w.shape) != tuple(x.shape[1:])):
        return (f"logits {list(x.shape)}, target {list(t.shape)}{'' if w is None else f', weight {list(w.shape)}'}"
                " (supports logits [N, V], target [N], weight [V])")
    return option_problem(attrs)


def kernel_problem(specs, attrs: dict) -> str | None:
    """What the NKI kernels decline alike: ``shape_problem``, empty logits, other dtypes."""
    why = shape_problem(specs, attrs)
    if why:
        return why
    x, t = specs[:2]
    if x.numel == 0:
        return "empty logits"
    if x.dtype not in ("float32", "bfloat16") or t.dtype not in ("int64", "int32"):
        return f"logits {x.dtype}, target {t.dtype} (supports float32/bfloat16 logits, int targets)"
    return None


def draw(rng, dtype: str) -> tuple:
    n, v = size(rng, 200), size(rng, 600) + 1
    attrs = {"ignore_index": rng.choice([-100, 0, 3]), "reduction": rng.choice(REDUCTIONS),
             "softcap": rng.choice([None, None, 30.0]), **draw_options(rng)}
    weight = ((v,), rng.choice([dtype, "float32"])) if rng.random() < 0.3 else None
    return (((n, v), dtype), ((n,), "int64"), weight), attrs



BENCHMARKS = (
    ((((64, 2048), "float32"), ((64,), "int64"), None), {}, {}),
    ((((1024, 32000), "float32"), ((1024,), "int64"), None), {}, {}),
    ((((2048, 32000), "float32"), ((2048,), "int64"), None), {}, {}),
    ((((1024, 32000), "float32"), ((1024,), "int64"), None), {"softcap": 30.0}, {}),  # Gemma 2 and 3's capped logits
    ((((1024, 32000), "float32"), ((1024,), "int64"), ((32000,), "float32")), {"label_smoothing": 0.1}, {}),
)
"""Vocabularies of real models for ``benchmarks/test_pack.py``."""

CROSS_ENTROPY = register_op(Op(
    name="cross_entropy", reference=reference, tensors=("logits", "target", "weight"), optional=("weight",),
    attrs={"ignore_index": int, "reduction": str, "softcap": float | None, **OPTION_TYPES},
    defaults={"ignore_index": -100, "reduction": "mean", "softcap": None, **OPTIONS},
    outputs=3, detached=(1, 2), differentiable=("logits",),
    waives={"special values in weight": CLASS_WEIGHTS}, data_dependent=("target",), make_inputs=make_inputs,
    draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 5), "float32"), ((1,), "int64"), None), {}),
        ((((9, 70), "float32"), ((9,), "int64"), None), {"reduction": "sum"}),
        ((((37, 1000), "float32"), ((37,), "int64"), None), {"softcap": 3.0}),
        ((((256, 4096), "float32"), ((256,), "int64"), None), {}),
        ((((33, 300), "float32"), ((33,), "int64"), ((300,), "float32")),
         {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "predictions": True}),
        ((((20, 90), "bfloat16"), ((20,), "int64"), ((90,), "float32")), {"reduction": "none", "softcap": 5.0,
                                                                           "label_smoothing": 0.2}),
    ),
))
