"""A linear layer, ``F.linear(x, weight, bias)``: x [..., in] (any leading dims), weight [out, in] stored either way
round (row-major, or the transpose of a row-major [in, out], as a tied or transposed weight is), bias [out] or None.
The layers a model's step spends most of its time in: a Hugging Face family's q/k/v/o projections and its MLP's
products (``hooks.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import rows, size


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor | None, ...]:
    """Inputs of unit spread, a weight of spread 1/sqrt(in) (outputs of spread about 1, as an initialised layer
    gives) stored as the key says (the transpose of a row-major [in, out] where its strides are (1, out)), a small
    bias where the key has one."""
    xs, ws, bs = key.inputs
    dtype = getattr(torch, xs.dtype)
    x = torch.randn(xs.shape, generator=gen).to(dtype)
    out, n_in = ws.shape
    transposed = ws.strides is not None and ws.strides == (1, out)
    w = torch.randn((n_in, out) if transposed else (out, n_in), generator=gen) / max(n_in, 1) ** 0.5
    w = (w.t() if transposed else w).to(getattr(torch, ws.dtype))
    b = None if bs is None else (0.1 * torch.randn(bs.shape, generator=gen)).to(getattr(torch, bs.dtype))
    return x, w, b


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    x, w, _ = tensors
    return (x.new_empty((*x.shape[:-1], w.shape[0])),)


def shape_problem(specs, attrs: dict | None = None) -> str | None:
    x, w, b = specs
    if len(x.shape) < 1 or len(w.shape) != 2 or x.shape[-1] != w.shape[1] or \
            (b is not None and tuple(b.shape) != tuple(w.shape[:1])):
        return (f"x {list(x.shape)}, weight {list(w.shape)}{'' if b is None else f', bias {list(b.shape)}'} "
                "(supports x [..., in], weight [out, in], bias [out])")
    return None


def draw(rng, dtype: str) -> tuple:
    n_in, n_out = size(rng, 96), size(rng, 160)
    w_shape = (n_out, n_in)
    weight = (w_shape, dtype) if rng.random() < 0.7 else (w_shape, dtype, (1, n_out))  # stored transposed
    bias = ((n_out,), dtype) if rng.random() < 0.4 else None
    return ((rows(rng, n_in), dtype), weight, bias), {}


BENCHMARKS = tuple(
    ((((512, i), "float32"), ((o, i), "float32"), None), {}, {})
    for i, o in ((576, 576), (576, 192), (576, 1536), (1536, 576))
) + (((((2048, 4096), "float32"), ((14336, 4096), "float32"), None), {}, {}),
     ((((2048, 14336), "float32"), ((4096, 14336), "float32"), None), {}, {}))
"""SmolLM2-135M's projections at 512 tokens (q and o 576->576, k and v 576->192, gate and up 576->1536, down
1536->576), and a Llama-3-8B MLP's up and down at 2048 tokens."""

LINEAR = register_op(Op(
    name="linear", reference=reference, tensors=("x", "weight", "bias"), optional=("bias",),
    differentiable=("x", "weight", "bias"), make_inputs=make_inputs, draw=draw, benchmarks=BENCHMARKS,
    waives={"special input values": "matrix products differ among BLAS libraries where a partial product overflows "
            "float32 beside an infinity: MKL's (the expression's on the CPU) rounds 1e20 * 1e20 to inf before "
            "adding, oneDNN's fused multiply-add does not (inf + -inf is nan in one, inf in the other, as in "
            "float64). tests/test_linear.py checks inf and nan inputs without overflowing products"},
    examples=(
        ((((1, 3), "float32"), ((5, 3), "float32"), None), {}),
        ((((2, 7, 33), "float32"), ((40, 33), "float32"), ((40,), "float32")), {}),
        ((((130, 64), "float32"), ((96, 64), "float32", (1, 96)), None), {}),
        ((((3, 45, 128), "bfloat16"), ((200, 128), "bfloat16"), ((200,), "bfloat16")), {}),
    ),
))
