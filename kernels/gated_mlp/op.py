"""A gated MLP as one op, ``down(act(gate(x)) * up(x))``: x [..., hidden], gate and up weights [inter, hidden] (or
one fused ``gate_up`` weight [2 * inter, hidden], gate rows first, as Phi-3 stores it, with ``up_weight`` None),
down weight [out, inter]. One op rather than three products and an activation: a kernel may keep the intermediate
per tile of tokens (never the whole [tokens, inter] gate and up), and pick each product's library."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import Key, Op, register_op
from ..shared.draws import rows, size

ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}
"""The gate's activations, by transformers' names (``config.hidden_act``)."""


def gate_up(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two projections, or the halves of the fused one (views of one product)."""
    if up_weight is None:
        return F.linear(x, gate_weight).chunk(2, dim=-1)
    return F.linear(x, gate_weight), F.linear(x, up_weight)


def reference(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor | None,
              down_weight: torch.Tensor, act: str = "silu") -> torch.Tensor:
    gate, up = gate_up(x, gate_weight, up_weight)
    return F.linear(ACTS[act](gate) * up, down_weight)


def make_inputs(key: Key, gen: torch.Generator, samples: dict | None = None, **_) -> tuple[torch.Tensor | None, ...]:
    """Inputs of unit spread and weights of spread 1/sqrt(fan-in), as an initialised layer has."""
    out = []
    for i, s in enumerate(key.inputs):
        if s is None:
            out.append(None)
            continue
        t = torch.randn(s.shape, generator=gen)
        out.append((t if i == 0 else t / max(s.shape[-1], 1) ** 0.5).to(getattr(torch, s.dtype)))
    return tuple(out)


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor]:
    x, _, _, down = tensors
    return (x.new_empty((*x.shape[:-1], down.shape[0])),)


def shape_problem(specs, attrs: dict) -> str | None:
    x, g, u, d = specs
    inter = (g.shape[0] // 2 if u is None else g.shape[0]) if len(g.shape) == 2 else -1
    fits = (len(x.shape) >= 1 and len(g.shape) == 2 and len(d.shape) == 2 and g.shape[1] == x.shape[-1]
            and (u is not None or g.shape[0] % 2 == 0)
            and (u is None or tuple(u.shape) == tuple(g.shape)) and d.shape[1] == inter)
    if not fits:
        got = ", ".join(f"{n} {list(s.shape)}" for n, s in zip(("x", "gate_weight", "up_weight", "down_weight"), specs)
                        if s is not None)
        return (f"{got} (supports x [..., hidden], gate_weight and up_weight [inter, hidden] or a fused gate_up "
                "[2 * inter, hidden] with up_weight None, down_weight [out, inter])")
    if attrs["act"] not in ACTS:
        return f"act {attrs['act']!r} (supports {', '.join(map(repr, ACTS))})"
    return None


def dtype_problem(specs) -> str | None:
    """What every impl asks of the dtypes: one of float32 or bfloat16 for all (the expression would promote)."""
    dtypes = {s.dtype for s in specs if s is not None}
    if len(dtypes) != 1 or not dtypes <= {"float32", "bfloat16"}:
        return f"dtypes {sorted(dtypes)} (supports one of float32 or bfloat16 for all)"
    return None


def draw(rng, dtype: str) -> tuple:
    hidden, inter, out = size(rng, 64), size(rng, 160), size(rng, 64)
    fused = rng.random() < 0.3
    gate = ((2 * inter if fused else inter, hidden), dtype)
    return (((rows(rng, hidden, 120)), dtype), gate, None if fused else ((inter, hidden), dtype),
            ((out, inter), dtype)), {"act": rng.choice(tuple(ACTS))}


def _site(tokens: int, hidden: int, inter: int, fused: bool = False, act: str = "silu") -> tuple:
    gate = ((2 * inter if fused else inter, hidden), "float32")
    return ((((tokens, hidden), "float32"), gate, None if fused else ((inter, hidden), "float32"),
             ((hidden, inter), "float32")), {"act": act}, {})


BENCHMARKS = (_site(512, 576, 1536), _site(512, 576, 1536, fused=True), _site(512, 896, 4864),
              _site(512, 640, 2048, act="gelu_pytorch_tanh"))
"""SmolLM2-135M's MLP at 512 tokens (and as Phi-3 stores it, fused), Qwen2.5-0.5B's, Gemma-3-270M's."""

GATED_MLP = register_op(Op(
    name="gated_mlp", reference=reference, tensors=("x", "gate_weight", "up_weight", "down_weight"),
    optional=("up_weight",), attrs={"act": str}, defaults={"act": "silu"},
    differentiable=("x", "gate_weight", "up_weight", "down_weight"), make_inputs=make_inputs, draw=draw,
    benchmarks=BENCHMARKS,
    waives={"bfloat16 within 1e-2": "the products run in bfloat16, as the expression's do (gate, up and their "
                                    "product rounded to bfloat16 before the down product): a weight gradient of a "
                                    "few elements summed over a hundred tokens that cancel is as far from float64 "
                                    "in the expression itself; held to twice the expression's own bfloat16 error",
            "special input values": "matrix products differ among BLAS libraries where a partial product overflows "
            "float32 beside an infinity (as linear's waiver says); tests/test_gated_mlp.py checks inf and nan "
            "inputs without overflowing products"},
    examples=(
        ((((1, 3), "float32"), ((5, 3), "float32"), ((5, 3), "float32"), ((3, 5), "float32")), {}),
        ((((2, 7, 33), "float32"), ((80, 33), "float32"), None, ((33, 40), "float32")), {}),
        ((((130, 64), "float32"), ((96, 64), "float32"), ((96, 64), "float32"), ((64, 96), "float32")),
         {"act": "gelu_pytorch_tanh"}),
        ((((3, 45, 128), "bfloat16"), ((200, 128), "bfloat16"), ((200, 128), "bfloat16"),
          ((128, 200), "bfloat16")), {}),
    ),
))
