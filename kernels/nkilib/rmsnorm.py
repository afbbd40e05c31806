"""``rmsnorm.nkilib_tkg``: the NKI Library's ``rmsnorm_tkg`` (core/subkernels/rmsnorm_tkg.py), RMSNorm for token
generation: inference only (it has no backward; a training call takes the compiler path).

The kernel reads x as [B, S, H] (the pack's rows, any leading dims, flattened to [1, rows, H]) with gamma [1, H],
and writes its output transposed for the sharded matmul that follows it in a decoder, [128, rows, H / 128]: hidden
index ``p * H1 + j`` at [p, row, j] (LNC=1), each half of H so laid out side by side (sharded over two programs),
or ``j * 128 + p`` (``hidden_dim_tp``). The impl gives the rows back in the pack's layout, one transposing copy.
It keeps every row of its output in SBUF at once, so it takes what fits there (decoding's few rows), H a multiple
of 128 (of 256 to shard H over two programs).

Config space, the kernel's switches: ``hidden_dim_tp`` (the H view it reads and writes), ``shard_on_h`` (LNC=2: the
programs split H and exchange partial sums, not rows) and ``single_core_forced`` (LNC=2: one program's work).
"""

from __future__ import annotations

from nkilib.core.subkernels.rmsnorm_tkg import BxS_FULL_TILE_SIZE, rmsnorm_tkg

from ...registry import Impl, Key, TensorSpec
from ...registry.cpu.runtime import require
from ...registry.neuron import logical_cores
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nki
from ..rmsnorm.op import RMSNORM, shape_problem
from ..shared.tiles import P_MAX, fits_sbuf

SOURCE_FAMILIES = ("nkilib",)
"""The library's kernel and its helpers count as this impl's source (``registry.sources``): a new release retunes."""

RMSNORM_TKG = nki.jit(rmsnorm_tkg)
"""The library's function (a sub-kernel, not marked ``nki.jit`` itself) as a kernel of its own."""
_ITEM = {"float32": 4, "bfloat16": 2, "float16": 2}


def _degree(config: dict) -> int:
    """Programs over which the kernel lays out H in its output (``num_H_shards``)."""
    return 1 if config["hidden_dim_tp"] or config["single_core_forced"] else logical_cores()


def forward(tensors, attrs, config):
    x, w = tensors
    h = x.shape[-1]
    rows = x.numel() // h
    out = x.new_empty((P_MAX, rows, h // P_MAX))
    out = run(RMSNORM_TKG, x.device)(x.reshape(1, rows, h), w.reshape(1, h), out, attrs["eps"], h,
                                     bool(config["hidden_dim_tp"]), bool(config["single_core_forced"]),
                                     bool(config["shard_on_h"]))
    out = out.to(x.device)
    if config["hidden_dim_tp"]:
        y = out.permute(1, 2, 0)  # [row, j, p]: hidden j * 128 + p
    else:
        n = _degree(config)
        y = out.reshape(P_MAX, rows, n, h // P_MAX // n).permute(1, 2, 0, 3)  # [row, half, p, j]
    return (y.reshape(x.shape),)


def fake(tensors, attrs):
    x, _ = tensors
    return (x.new_empty(x.shape),)


def sbuf_bytes(rows: int, h: int, dtype: str) -> int:
    """Bytes per partition: the output of every row, gamma, the constants, and a tile of up to 512 rows' float32
    square and scaled input."""
    h1 = h // P_MAX
    tile = min(rows, BxS_FULL_TILE_SIZE)
    return rows * h1 * _ITEM[dtype] + h1 * _ITEM[dtype] + 4 + P_MAX * 4 + tile * (2 * h1 * 4 + 8)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs) or require(specs, {0: tuple(_ITEM), 1: tuple(_ITEM)})
    if why:
        return why
    x, w = specs
    if any(s.requires_grad for s in specs):
        return "a training call (rmsnorm_tkg is an inference kernel: it has no backward)"
    if x.numel == 0:
        return "empty x"
    h = x.shape[-1]
    if h % P_MAX:
        return f"hidden size {h} (rmsnorm_tkg takes multiples of {P_MAX})"
    rows = x.numel // h
    if not fits_sbuf(sbuf_bytes(rows, h, x.dtype)):
        return f"{rows} rows of {h} (rmsnorm_tkg keeps every row in SBUF: it is made for decoding's few)"
    return None


def constraint(config: dict, key: Key) -> bool:
    """The kernel's rules: ``shard_on_h`` needs LNC=2, H a multiple of 256, and neither other switch;
    ``single_core_forced`` means something at LNC=2 only."""
    h, lnc = key.inputs[0].shape[-1], logical_cores()
    if config["shard_on_h"]:
        return lnc == 2 and h % (P_MAX * lnc) == 0 and not (config["hidden_dim_tp"] or config["single_core_forced"])
    return lnc == 2 or not config["single_core_forced"]


IMPL = Impl(
    op=RMSNORM, name="nkilib_tkg", backend="neuron", forward=forward, fake=fake, supports=supports,
    space={"hidden_dim_tp": (0, 1), "shard_on_h": (0, 1), "single_core_forced": (0, 1)},
    default={"hidden_dim_tp": 0, "shard_on_h": 0, "single_core_forced": 0}, constraint=constraint,
    examples=(  # decoding's rows: one token of a batch of 4; two tokens of 3 sequences
        ((((4, 256), "float32"), ((256,), "float32")), {}),
        ((((3, 2, 512), "bfloat16"), ((512,), "bfloat16")), {}),
    ),
)
