"""Embedding in NKI: rows gathered by indirect DMA, whose bounds check (``oob_mode=error``) rejects an id outside
the table; the weight gradient as a one-hot matmul on TensorE (duplicate ids are summed by the matmul itself, where
a gather-add-scatter would lose them)."""

from __future__ import annotations

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import int32_column, run
from ...registry.neuron.nki import nki, nl
from ..shared.tiles import ROWS, fits_sbuf, gather_rows, indirect_problem, segment_matmul
from .op import EMBEDDING, fake

CHUNK = (128, 512)


@nki.jit
def embedding_fwd(ids, weight, rows_per_tile):
    """ids: HBM [n, 1] int32; weight: [V, D] -> [n, D]."""
    out = nl.ndarray((ids.shape[0], weight.shape[1]), dtype=weight.dtype, buffer=nl.shared_hbm)
    gather_rows(weight, ids, out, rows_per_tile)
    return out


@nki.jit
def embedding_bwd(dy, ids, vocab, rows_per_tile, chunk):
    """dy: [n, D]; ids: [n, 1] int32 -> dweight [vocab, D] float32."""
    dw = nl.ndarray((vocab, dy.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    segment_matmul(dy, ids, dw, rows_per_tile, chunk)
    return dw


def forward(tensors, attrs, config):
    ids, w = tensors
    out = run(embedding_fwd, w.device)(int32_column(ids), w, config["rows_per_tile"])
    return (out.reshape(*ids.shape, w.shape[1]).to(w.device),)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (ids, w) = grads, tensors
    dw = run(embedding_bwd, w.device)(dy.reshape(-1, w.shape[1]), int32_column(ids), w.shape[0],
                                     config["rows_per_tile"], config["chunk"])
    return (dw.to(w.dtype).to(w.device),)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    ids, w = specs
    if ids.dtype not in ("int64", "int32") or w.dtype not in ("float32", "bfloat16") or len(w.shape) != 2:
        return f"ids {ids.dtype}, weight {w.dtype} {list(w.shape)} (supports int ids, a float32/bfloat16 [V, D])"
    why = indirect_problem()
    if why:
        return why
    if attrs["padding_idx"] is not None:
        return f"padding_idx={attrs['padding_idx']} (this kernel's weight gradient has no padding row)"
    if w.shape[0] >= 1 << 24:
        return f"vocabulary {w.shape[0]} (ids are compared in float32: under 2^24)"
    if not fits_sbuf(4 * w.shape[1] + 8):
        return f"width {w.shape[1]} (a row must fit one partition of SBUF)"
    return None


def constraint(config: dict, key: Key) -> bool:
    n = 1
    for s in key.inputs[0].shape:
        n *= s
    return config["rows_per_tile"] <= max(32, n) and fits_sbuf(4 * config["chunk"] * 2 + 4 * 128 * 2)


NKI_GATHER = register_impl(Impl(
    op=EMBEDDING, name="nki_gather", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS, "chunk": CHUNK}, default={"rows_per_tile": 128, "chunk": 512},
    constraint=constraint, backward_params=("chunk",),
))
