"""``rope.nkilib_hf``: the NKI Library's ``rope_hf`` (core/embeddings/rope_hf.py), Hugging Face layout.

The library's layout is the pack's: q, k [batch, heads, seq, dim], cos, sin [batch, seq, dim] or [seq, dim] (the
pack's cos/sin of batch 1 are passed so). The kernel shards the sequence over the programs of an LNC launch in
tiles of 128 positions, so it takes sequences that are a multiple of 128 x LNC (its NCC_INKI016 assertion), and it
reads contiguous tensors only (flat ``.ap()`` offsets): transposed q/k views take the compiler path. It computes in
the inputs' dtype. With ``backward=True`` it rotates by the opposite angle, which is the gradient of q and k; the
gradients of cos and sin, where asked for (Hugging Face's are computed from positions and need none), are the
reference's formula. The kernel has no tunable parameter: its config space is empty.
"""

from __future__ import annotations

import torch
from nkilib.core.embeddings.rope_hf import rope_hf

from ...registry import Impl, TensorSpec
from ...registry.cpu.runtime import require
from ...registry.neuron import logical_cores
from ...registry.neuron.launch import run
from ..rope.op import ROPE, fake, rotate_half, shape_problem
from ..shared.tiles import P_MAX, fits_sbuf

SOURCE_FAMILIES = ("nkilib",)
"""The library's kernel and its helpers count as this impl's source (``registry.sources``): a new release retunes."""

COALESCED = 8
"""Sequence tiles the kernel loads at once (its NUM_COALESCE_TILES)."""
_ITEM = {"float32": 4, "bfloat16": 2}


def _tables(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as the kernel takes them: [batch, seq, dim], or [seq, dim] for all batches."""
    if cos.shape[0] == 1 and batch != 1:
        return cos[0], sin[0]
    return cos, sin


def _rotate(q, k, cos, sin, backward: bool):
    c, s = _tables(cos, sin, q.shape[0])
    qo, ko = run(rope_hf, q.device)(q, k, torch.empty_like(q), torch.empty_like(k), c, s, None, backward)
    return qo.to(q.device), ko.to(k.device)


def forward(tensors, attrs, config):
    q, k, cos, sin = tensors
    return _rotate(q, k, cos, sin, False)


def _sum_heads(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum over heads (and over batch for cos/sin of batch 1), in float32."""
    g = g.sum(1)
    return g.sum(0, keepdim=True) if like.shape[0] == 1 else g


def backward(grads, tensors, results, attrs, config, needs):
    (gq, gk), (q, k, cos, sin) = grads, tensors
    dq, dk = _rotate(gq.contiguous(), gk.contiguous(), cos, sin, True)
    if not (needs[2] or needs[3]):
        return dq, dk, None, None
    gq, gk, q, k = (t.float() for t in (gq, gk, q, k))
    dcos = _sum_heads(gq * q, cos) + _sum_heads(gk * k, cos)
    dsin = _sum_heads(gq * rotate_half(q), sin) + _sum_heads(gk * rotate_half(k), sin)
    return dq, dk, dcos.to(cos.dtype), dsin.to(sin.dtype)


def sbuf_bytes(d: int, dtype: str) -> int:
    """Bytes per partition of the kernel's live tiles: cos, sin, the head's tile, its result, two half temporaries,
    each ``COALESCED`` tiles wide."""
    return COALESCED * d * _ITEM[dtype] * 5


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs) or require(specs, {i: tuple(_ITEM) for i in range(4)})
    if why:
        return why
    q = specs[0]
    if q.numel == 0:
        return "empty q"
    lnc = logical_cores()
    if q.shape[2] % (P_MAX * lnc):
        return (f"sequence {q.shape[2]} (rope_hf takes multiples of {P_MAX} x LNC={lnc}: tiles of {P_MAX} positions "
                "per program)")
    if not fits_sbuf(sbuf_bytes(q.shape[3], q.dtype)):
        return f"head dim {q.shape[3]} (its tiles do not fit the SBUF)"
    return None


IMPL = Impl(
    op=ROPE, name="nkilib_hf", backend="neuron", forward=forward, backward=backward, fake=fake, supports=supports,
    reads={"q": ("cos", "sin"), "k": ("cos", "sin"), "cos": ("q", "k", "cos", "sin"),
           "sin": ("q", "k", "cos", "sin")},
    examples=(  # sequences of 256: two tiles, one per program at LNC=2
        ((((1, 2, 256, 64), "float32"), ((1, 1, 256, 64), "float32"), ((1, 256, 64), "float32"),
          ((1, 256, 64), "float32")), {}),
        ((((2, 2, 256, 32), "bfloat16"), ((2, 1, 256, 32), "bfloat16"), ((1, 256, 32), "bfloat16"),
          ((1, 256, 32), "bfloat16")), {}),
    ),
)
