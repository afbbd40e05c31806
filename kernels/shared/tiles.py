"""What the pack's NKI kernels share: the limits they tile for, the split of their work over the programs of an
LNC launch, a bounds check of indices by the DMA engine, and the row gather and one-hot segment matmul that
embedding and segment_sum are built from.

LNC: a kernel launched at LNC=2 runs once per physical core, each with its own ``nl.program_id(0)`` and all on the
same shared-HBM inputs and outputs (docs: nki/get-started/about/lnc.rst); every kernel of the pack gives each
program a disjoint share of its tiles, so any degree gives the same result.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from ...registry.neuron.limits import limits_target
from ...registry.neuron.nki import nisa, nl

P_MAX = 128
ROWS = (32, 64, 128)
T = TypeVar("T")


def fits_sbuf(nbytes: int) -> bool:
    return nbytes <= limits_target().sbuf_partition_bytes


def indirect_problem() -> str | None:
    """Why kernels that gather or scatter by index (indirect DMA) cannot run on the target, or None."""
    t = limits_target()
    if t.indirect_dma:
        return None
    return f"indirect DMA (gather/scatter by index) needs NeuronCore-v3 or newer (trn2, trn3); the target is {t.name}"


def tiles(n: int, p: int) -> Iterator[tuple[int, int, int]]:
    """(index, start, size) of each tile of p rows over n rows; the last may be short."""
    for t in range((n + p - 1) // p):
        yield t, t * p, min(p, n - t * p)


def strided_row_tiles(lead: tuple[tuple[int, int], ...], p: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(index, first row, rows, start, step) of each tile of up to p rows of a tensor whose leading dims are
    ``lead``, (size, stride) pairs (``launch.strided_rows``), rows in row-major order: a tile stays within the
    innermost leading dim, and its rows start ``step`` elements apart from element ``start`` of the tensor's memory."""
    *outer, (inner, step) = lead
    starts = [0]
    for n, s in outer:
        starts = [a + i * s for a in starts for i in range(n)]
    t = 0
    for g, start in enumerate(starts):
        for _, s0, n in tiles(inner, p):
            yield t, g * inner + s0, n, start + s0 * step, step
            t += 1


def mine(items: Iterable[T]) -> Iterator[T]:
    """This program's share of ``items``: every ``num_programs()``-th, from its ``program_id(0)``."""
    pid, count = nl.program_id(0), nl.num_programs()
    for i, item in enumerate(items):
        if i % count == pid:
            yield item


def check_rows(idx, k: int, table) -> None:
    """Fail unless every index of ``idx[0:k]`` (SBUF int32 column) is a row of ``table`` (HBM [R, C]): a gather of
    one element per row with ``oob_mode=error``, the DMA engine's bounds check of dynamic accesses (nki.isa.dma_copy:
    "out-of-bound address checking is turned on automatically ... a runtime error is raised"). It moves the index
    checks a host would make into the kernel, so the op body stays free of data-dependent host code."""
    probe = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    cols = table.shape[1]
    nisa.dma_copy(dst=probe[0:k, :], src=table.ap(pattern=[[cols, k], [1, 1]], offset=0, vector_offset=idx[0:k, :],
                                                   indirect_dim=0), oob_mode=nisa.oob_mode.error)


def gather_rows(table, idx_col, out, p: int) -> None:
    """out[i, :] = table[idx[i], :] by indirect DMA; table HBM [V, F], idx_col HBM [n, 1] int32, out HBM [n, F].
    An index outside the table is a DMA error."""
    n, f = out.shape
    for _, r0, k in mine(tiles(n, p)):
        idx = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx[0:k, :], src=idx_col[r0:r0 + k, :])
        rows = nl.ndarray((p, f), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[0:k, :], src=table.ap(pattern=[[f, k], [1, f]], offset=0, vector_offset=idx[0:k, :],
                                                    indirect_dim=0))
        nisa.dma_copy(dst=out[r0:r0 + k, :], src=rows[0:k, :])


def segment_matmul(src, idx_col, out, p: int, chunk: int) -> None:
    """out[s, :] = sum of src[i, :] over the i with idx[i] == s, as one-hot[n, S].T @ src[n, F] on TensorE.

    Duplicate indices are simply summed by the matmul (no read-modify-write races); each block of 128 output rows
    and ``chunk`` columns accumulates over the row tiles in one PSUM bank. The programs of an LNC launch take
    disjoint blocks of output rows.
    """
    n, f = src.shape
    segs = out.shape[0]
    for s0 in mine(range(0, segs, P_MAX)):
        ms = min(P_MAX, segs - s0)
        for c0 in range(0, f, chunk):
            m = min(chunk, f - c0)
            ps = nl.ndarray((P_MAX, chunk), dtype=nl.float32, buffer=nl.psum)
            for t, r0, k in tiles(n, p):
                idf = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=idf[0:k, :], src=idx_col[r0:r0 + k, :])
                io = nl.ndarray((p, P_MAX), dtype=nl.int32, buffer=nl.sbuf)
                nisa.iota(dst=io[0:k, 0:ms], pattern=[[1, ms]], offset=s0)
                onehot = nl.ndarray((p, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=onehot[0:k, 0:ms], src=io[0:k, 0:ms])
                nisa.tensor_scalar(dst=onehot[0:k, 0:ms], data=onehot[0:k, 0:ms], op0=nl.equal, operand0=idf[0:k, :])
                st = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=st[0:k, 0:m], src=src[r0:r0 + k, c0:c0 + m])
                nisa.nc_matmul(dst=ps[0:ms, 0:m], stationary=onehot[0:k, 0:ms], moving=st[0:k, 0:m],
                               accumulate=t > 0)
            sb = nl.ndarray((P_MAX, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=sb[0:ms, 0:m], src=ps[0:ms, 0:m])
            nisa.dma_copy(dst=out[s0:s0 + ms, c0:c0 + m], src=sb[0:ms, 0:m])
