"""``attention.nkilib_cte``: the NKI Library's ``attention_cte`` (core/attention/attention_cte.py, context encoding)
for the forward and ``attention_bwd`` (core/attention/attention_bwd.py) for the backward.

attention_cte takes batch and heads as one dim: q [b*h, s, d] (``tp_q``), k and v [b*hk, s, d] (``tp_k``), GQA as
the repeat-interleave of k/v over that dim, which is the pack's grouping of heads; it writes [b*h, s, d]. Its
``cache_softmax`` gives each query row's max and reciprocal sum in tiles of 128 rows, from which the impl keeps the
log-sum-exp ([b, h, s], float32) that the backward reads. attention_bwd takes every tensor transposed, [b, h, d, s],
and the log-sum-exp in tiles, [b, h, 128, s / 128]; the impl transposes around it. Causal is top-left in both, as in
``F.scaled_dot_product_attention``.

Declined (the compiler path): a mask (the kernels take causal, sliding-window and packed-sequence bounds only),
head dims over 128, sequences that are not multiples of 128 (the softmax cache's tiles), a key sequence over 512
that is not a multiple of 512 (attention_bwd's key tiles), causal training with other query and key lengths.
It takes bfloat16 only: the forward computes its matmuls in bfloat16 (``DTYPES``). Config space: attention_bwd's
``mixed_precision`` (float32 softmax and reductions).
"""

from __future__ import annotations

import math

import torch
from nkilib.core.attention.attention_bwd import attention_bwd
from nkilib.core.attention.attention_cte import attention_cte

from ...registry import Impl, TensorSpec
from ...registry.cpu.runtime import require
from ...registry.neuron.launch import run
from ..attention.op import ATTENTION, fake, shape_problem
from ..shared.tiles import P_MAX

SOURCE_FAMILIES = ("nkilib",)
"""The library's kernels and their helpers count as this impl's source (``registry.sources``): a new release
retunes."""

K_TILE = 512
"""attention_bwd's key tile (``psum_fmax``): a key sequence over it is a multiple of it."""
DTYPES = ("bfloat16",)
"""attention_cte "uses float32 for softmax and bfloat16 for other operations" (its docstring): float32 inputs come
out 2.5e-3 from float64 (its test: 2e-2), over float32's 1e-5; float16's 1e-3 is beyond it too."""


def _scale(q: torch.Tensor, attrs: dict) -> float:
    return attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])


def forward(tensors, attrs, config):
    q, k, v, _ = tensors
    b, h, n, d = q.shape
    hk, m = k.shape[1], k.shape[2]
    out, neg_max, recip = run(attention_cte, q.device)(
        q.reshape(b * h, n, d), k.reshape(b * hk, m, d), v.reshape(b * hk, m, d), _scale(q, attrs), attrs["causal"],
        None, None, None, None, 0, True, True, False, True)
    lse = -(neg_max.to(q.device).float() + torch.log(recip.to(q.device).float()))  # [b*h, 128, n / 128]
    lse = lse.reshape(b, h, P_MAX, n // P_MAX).transpose(-1, -2).reshape(b, h, n)
    return out.reshape(b, h, n, d).to(q.device), lse


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2).contiguous()


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (q, k, v, _), (o, lse) = grads, tensors, results
    b, h, n, _ = q.shape
    tiles = lse.reshape(b, h, n // P_MAX, P_MAX).transpose(-1, -2).contiguous()
    dq, dk, dv = run(attention_bwd, q.device)(_t(q), _t(k), _t(v), _t(o), _t(dy.to(q.dtype)), tiles, None, None, None,
                                              attrs["causal"], bool(config["mixed_precision"]), _scale(q, attrs))
    return (*(g.to(q.device).transpose(-1, -2) for g in (dq, dk, dv)), None)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs) or require(specs[:3], {i: DTYPES for i in range(3)})
    if why:
        return why
    q, k, v, mask = specs
    if mask is not None:
        return "a mask (attention_cte takes causal, sliding-window and packed-sequence masks only)"
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    if not q.numel or not k.numel:
        return "empty q or k"
    if d > P_MAX or v.shape[3] != d:
        return f"head dims {d}, {v.shape[3]} (attention_cte takes one head dim up to {P_MAX})"
    if n % P_MAX or m % P_MAX:
        return f"sequences {n}, {m} (attention_cte and attention_bwd take multiples of {P_MAX})"
    training = any(s.requires_grad for s in specs[:3])
    if training and m > K_TILE and m % K_TILE:
        return f"key sequence {m} (attention_bwd takes multiples of {K_TILE} over {K_TILE})"
    if training and attrs["causal"] and n != m:
        return f"causal training over {n} queries and {m} keys (attention_bwd takes equal lengths)"
    return None


IMPL = Impl(
    op=ATTENTION, name="nkilib_cte", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"mixed_precision": (0, 1)}, default={"mixed_precision": 1},
    backward_params=("mixed_precision",), saved=1,
    reads={"q": ("q", "k", "v", "result_0", "result_1"), "k": ("q", "k", "v", "result_0", "result_1"),
           "v": ("q", "k", "v", "result_0", "result_1"), "mask": ()},
    examples=(  # one tile of 128 queries; GQA with two tiles of keys
        ((((1, 2, 128, 32), "bfloat16"), ((1, 1, 128, 32), "bfloat16"), ((1, 1, 128, 32), "bfloat16"), None),
         {"causal": True}),
        ((((1, 2, 128, 32), "bfloat16"), ((1, 1, 256, 32), "bfloat16"), ((1, 1, 256, 32), "bfloat16"), None), {}),
    ),
)
