"""``gated_mlp.nkilib``: the NKI Library's gated MLP (core/mlp), its context-encoding kernel ``mlp_cte``
(core/mlp/mlp_cte/mlp_cte.py) for every call: inference only (the library has no MLP backward; a training call
takes the compiler path).

The library's entry point (core/mlp/mlp.py) does not parse in the release this was written against (a docstring's
tail is repeated after it closes: ``IndentationError``), and its token-generation kernel (``mlp_tkg``, which it
picks for 96 tokens or fewer) builds its constants without a field its dataclass requires (``remainderIFused``):
so this impl does what the entry point does for the context-encoding kernel, ``force_cte_mode`` set, which serves
any number of tokens. It builds ``MLPParameters``, runs the library's validation, and calls ``mlp_cte``.

The kernel reads x as [B, S, H] (the pack's rows flattened to [1, rows, H]) and each weight as a row-major
[in, out]: gate and up [H, I], down [I, H] (``F.linear``'s weights transposed). A weight stored that way (the
transpose of a row-major one) is passed as it is; a weight in ``nn.Linear``'s layout is transposed into a copy per
call, as are the halves of a fused ``gate_up``. Declined: float32 (the kernel computes a float32 call in bfloat16,
``_get_compute_data_type``: 5e-3 from float64, over float32's tolerance), H not a multiple of 128, a down
projection to other than H columns. The kernel has no parameter to tune: the config space is empty.
"""

from __future__ import annotations

import math

import torch
from nkilib.core.mlp.mlp_cte.mlp_cte import mlp_cte
from nkilib.core.mlp.mlp_parameters import MLPParameters, validate_mlp_arguments
from nkilib.core.utils.common_types import ActFnType

from ...registry import Impl, TensorSpec
from ...registry.cpu.runtime import require
from ...registry.neuron import logical_cores
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nki, nl
from ..gated_mlp.op import GATED_MLP, fake, shape_problem
from ..shared.tiles import P_MAX

SOURCE_FAMILIES = ("nkilib",)
"""The library's kernel and its helpers count as this impl's source (``registry.sources``): a new release retunes."""

ACTS = {"silu": ActFnType.SiLU, "gelu_pytorch_tanh": ActFnType.GELU_Tanh_Approx}
DTYPES = ("bfloat16",)


@nki.jit
def mlp_context(hidden, gate, up, down, act):
    """The library's ``mlp`` for its context-encoding kernel: hidden [B, S, H], gate and up [H, I], down [I, H]."""
    params = MLPParameters(hidden_tensor=hidden, gate_proj_weights_tensor=gate, up_proj_weights_tensor=up,
                           down_proj_weights_tensor=down, activation_fn=act, force_cte_mode=True)
    validate_mlp_arguments(params)
    out = nl.ndarray((params.batch_size, params.sequence_len, params.hidden_size), dtype=params.output_dtype,
                     buffer=nl.shared_hbm)
    mlp_cte(params, out, None)
    return out


def _in_out(w: torch.Tensor) -> torch.Tensor:
    """``F.linear``'s [out, in] weight as the kernel reads it, row-major [in, out]: a view where it is stored so."""
    return w.t().contiguous()


def forward(tensors, attrs, config):
    x, gw, uw, dw = (None if t is None else t.detach() for t in tensors)
    gate, up = gw.chunk(2, dim=0) if uw is None else (gw, uw)
    h = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    y = run(mlp_context, x.device)(x.reshape(1, rows, h).contiguous(), _in_out(gate), _in_out(up), _in_out(dw),
                                   ACTS[attrs["act"]])
    return (y.to(x.device).reshape(x.shape),)


def _shards_tokens(h: int, inter: int, rows: int) -> bool:
    """Whether the kernel's two programs (LNC=2) split the tokens rather than the intermediate: the library's
    choice (``mlp_cte_sharding.calculate_sharding``), without projection biases (the op has none)."""
    on_inter = rows <= 256 or (inter > 2048 and inter % 256 == 0)
    if h < 7168 or inter < 1024:
        on_inter = False
    return not (on_inter or inter > 4096)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    why = require(specs, {i: DTYPES for i, s in enumerate(specs) if s is not None}, contiguous=False)
    if why:
        return f"{why} (the kernel computes in bfloat16: a float32 call comes out 5e-3 from float64)"
    if any(s is not None and s.requires_grad for s in specs):
        return "a training call (the library's MLP is an inference kernel: it has no backward)"
    x, _, _, d = specs
    h = x.shape[-1]
    if h % P_MAX or h == 0:
        return f"hidden size {h} (the library's MLP takes multiples of {P_MAX})"
    if d.shape[0] != h or d.shape[1] == 0 or math.prod(x.shape[:-1]) == 0:
        return "a down projection to other than the hidden size, or no tokens or intermediate"
    rows, lnc = math.prod(x.shape[:-1]), logical_cores()
    if lnc > 1 and rows % lnc and _shards_tokens(h, d.shape[1], rows):
        return f"{rows} tokens at LNC={lnc} (the kernel's programs split the tokens: a multiple of {lnc})"
    return None


IMPL = Impl(
    op=GATED_MLP, name="nkilib", backend="neuron", forward=forward, fake=fake, supports=supports,
    examples=(
        ((((2, 5, 128), "bfloat16"), ((200, 128), "bfloat16"), ((200, 128), "bfloat16"),
          ((128, 200), "bfloat16")), {}),
        ((((130, 256), "bfloat16"), ((1024, 256), "bfloat16"), None, ((256, 512), "bfloat16")),
         {"act": "gelu_pytorch_tanh"}),
    ),
)
