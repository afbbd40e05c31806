"""Cross-entropy of logits [N, V] against int64 targets [N]: the mean over the targets not ignored, or the sum; the
logits optionally capped first (``softcap``: ``cap * tanh(logits / cap)``, Gemma 2 and 3's
``final_logit_softcapping``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import size
from ..shared.loss import REDUCTIONS, cap_problem, capped


def reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
              softcap: float | None = None) -> torch.Tensor:
    return F.cross_entropy(capped(logits, softcap), target, ignore_index=ignore_index, reduction=reduction)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, ignored: float = 0.05,
                **_) -> tuple[torch.Tensor, ...]:
    """Logits of a half-trained model (spread about 2) and targets with a few ignored (padding) positions."""
    ls, ts = key.inputs[0].shape, key.inputs[1].shape
    logits = 2.0 * torch.randn(ls, generator=gen, dtype=getattr(torch, key.inputs[0].dtype))
    if samples is not None and "target" in samples and tuple(samples["target"].shape) == tuple(ts):
        return logits, samples["target"].clone()
    target = torch.randint(0, ls[-1], ts, generator=gen)
    pad = torch.rand(ts, generator=gen) < ignored
    pad.view(-1)[:1] = False  # at least one target counts: an all-ignored batch has no loss to compare
    return logits, target.masked_fill(pad, key.attr_dict["ignore_index"])


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and the per-row log-sum-exp every impl keeps for its backward."""
    x, _ = tensors
    return x.new_empty(()), x.new_empty(x.shape[:1], dtype=torch.float32)


def shape_problem(specs, attrs: dict) -> str | None:
    x, t = specs
    if len(x.shape) != 2 or len(t.shape) != 1 or t.shape[0] != x.shape[0]:
        return f"logits {list(x.shape)} and target {list(t.shape)} (supports logits [N, V], target [N])"
    if attrs["reduction"] not in REDUCTIONS:
        return f"reduction={attrs['reduction']!r} (supports {', '.join(map(repr, REDUCTIONS))})"
    return cap_problem(attrs.get("softcap"))


def kernel_problem(specs, attrs: dict) -> str | None:
    """What the NKI kernels decline alike: ``shape_problem``, empty logits, other dtypes."""
    why = shape_problem(specs, attrs)
    if why:
        return why
    x, t = specs
    if x.numel == 0:
        return "empty logits"
    if x.dtype not in ("float32", "bfloat16") or t.dtype not in ("int64", "int32"):
        return f"logits {x.dtype}, target {t.dtype} (supports float32/bfloat16 logits, int targets)"
    return None


def draw(rng, dtype: str) -> tuple:
    n, v = size(rng, 200), size(rng, 600) + 1
    attrs = {"ignore_index": rng.choice([-100, 0, 3]), "reduction": rng.choice(REDUCTIONS),
             "softcap": rng.choice([None, None, 30.0])}
    return (((n, v), dtype), ((n,), "int64")), attrs


BENCHMARKS = (
    ((((64, 2048), "float32"), ((64,), "int64")), {}, {}),
    ((((1024, 32000), "float32"), ((1024,), "int64")), {}, {}),
    ((((2048, 32000), "float32"), ((2048,), "int64")), {}, {}),
    ((((1024, 32000), "float32"), ((1024,), "int64")), {"softcap": 30.0}, {}),  # Gemma 2 and 3's capped logits
)
"""Vocabularies of real models for ``benchmarks/test_pack.py``."""

CROSS_ENTROPY = register_op(Op(
    name="cross_entropy", reference=reference, tensors=("logits", "target"),
    attrs={"ignore_index": int, "reduction": str, "softcap": float | None},
    defaults={"ignore_index": -100, "reduction": "mean", "softcap": None},
    differentiable=("logits",), data_dependent=("target",), make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    examples=(
        ((((1, 5), "float32"), ((1,), "int64")), {}),
        ((((9, 70), "float32"), ((9,), "int64")), {"reduction": "sum"}),
        ((((37, 1000), "float32"), ((37,), "int64")), {"softcap": 3.0}),
        ((((256, 4096), "float32"), ((256,), "int64")), {}),
    ),
))
