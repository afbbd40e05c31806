"""Segment sum in NKI: a one-hot matmul on TensorE (repeated indices add up, empty segments stay zero), the
indices bounds-checked in the kernel by the DMA engine; its src gradient, a row gather by indirect DMA."""

from __future__ import annotations

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import int32_column, run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.tiles import ROWS, check_rows, gather_rows, indirect_problem, mine, segment_matmul, tiles
from .op import SEGMENT_SUM, fake, shape_problem

CHUNK = (128, 512)


@nki.jit
def segment_sum_fwd(src, index, num_segments, rows_per_tile, chunk):
    """src: [n, F]; index: [n, 1] int32 -> [num_segments, F] float32."""
    out = nl.ndarray((num_segments, src.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    for _, r0, k in mine(tiles(index.shape[0], rows_per_tile)):  # an index outside [0, num_segments) fails here
        idx = nl.ndarray((rows_per_tile, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx[0:k, :], src=index[r0:r0 + k, :])
        check_rows(idx, k, out)
    segment_matmul(src, index, out, rows_per_tile, chunk)
    return out


@nki.jit
def segment_sum_bwd(dy, index, rows_per_tile):
    """dy: [S, F]; index: [n, 1] -> dsrc [n, F] = dy[index]."""
    out = nl.ndarray((index.shape[0], dy.shape[1]), dtype=dy.dtype, buffer=nl.shared_hbm)
    gather_rows(dy, index, out, rows_per_tile)
    return out


def forward(tensors, attrs, config):
    src, index = tensors
    n = attrs["num_segments"]
    out = run(segment_sum_fwd, src.device)(src.reshape(src.shape[0], -1), int32_column(index), n,
                                           config["rows_per_tile"], config["chunk"])
    return (out.to(src.dtype).reshape(n, *src.shape[1:]).to(src.device),)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (src, index) = grads, tensors
    dsrc = run(segment_sum_bwd, src.device)(dy.reshape(dy.shape[0], -1), int32_column(index),
                                            config["rows_per_tile"])
    return (dsrc.reshape(src.shape).to(src.device),)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    src, index = specs
    if src.dtype not in ("float32", "bfloat16") or index.dtype not in ("int64", "int32"):
        return f"src {src.dtype}, index {index.dtype} (supports float32/bfloat16 src, int index)"
    why = indirect_problem()
    if why:
        return why
    if not 1 <= attrs["num_segments"] < 1 << 24:
        return f"num_segments={attrs['num_segments']} (1 up to 2^24: indices are compared in float32)"
    return None


def constraint(config: dict, key: Key) -> bool:
    return config["rows_per_tile"] <= max(32, key.inputs[1].shape[0])


NKI_MATMUL = register_impl(Impl(
    op=SEGMENT_SUM, name="nki_matmul", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS, "chunk": CHUNK}, default={"rows_per_tile": 128, "chunk": 512},
    constraint=constraint,
))
