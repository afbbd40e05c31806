"""Gather and scatter-add over rows, shared by embedding and segment_sum (each one's backward is the other).

Scatter-add has three strategies, a config choice of both ops: ``serial`` (one pass, no
parallel launch: best when small), ``blocks`` (each task owns a block of output rows and
scans all indices: no conflicts, indices read once per task), ``sorted`` (indices sorted
once, each task sums whole runs of equal indices: best for long runs and skewed ids).
The gather copies elements as they are (bfloat16 bits included); the scatter-add reads float32 or bfloat16
and sums into a float32 output.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...registry.cpu.runtime import f32, kernel, launch

SERIAL, BLOCKS, SORTED = 0, 1, 2


def _gather_body(table, idx, out):
    n, f = out.shape
    for i in prange(n):
        row = idx[i]
        for j in range(f):
            out[i, j] = table[row, j]


def _scatter_serial_body(src, idx, out):
    n, f = src.shape
    for r in range(out.shape[0]):
        for j in range(f):
            out[r, j] = 0.0
    for i in range(n):
        row = idx[i]
        for j in range(f):
            out[row, j] += f32(src[i, j])


def _scatter_blocks_body(src, idx, out, blocks):
    n, f = src.shape
    rows = out.shape[0]
    per = (rows + blocks - 1) // blocks
    for b in prange(blocks):
        lo = b * per
        hi = min(rows, lo + per)
        for r in range(lo, hi):
            for j in range(f):
                out[r, j] = 0.0
        for i in range(n):
            row = idx[i]
            if lo <= row < hi:
                for j in range(f):
                    out[row, j] += f32(src[i, j])


def _scatter_sorted_body(src, order, starts, segs, out):
    f = src.shape[1]
    for r in prange(out.shape[0]):
        for j in range(f):
            out[r, j] = 0.0
    for u in prange(segs.shape[0]):
        row = segs[u]
        for k in range(starts[u], starts[u + 1]):
            i = order[k]
            for j in range(f):
                out[row, j] += f32(src[i, j])


_gather = kernel(_gather_body)
_scatter_serial = kernel(_scatter_serial_body)
_scatter_blocks = kernel(_scatter_blocks_body)
_scatter_sorted = kernel(_scatter_sorted_body)


def gather(table: np.ndarray, idx: np.ndarray, out: np.ndarray, threads: int) -> None:
    launch(_gather, threads, table, idx, out)


def scatter_add(src: np.ndarray, idx: np.ndarray, out: np.ndarray, mode: int, threads: int) -> None:
    """out = zeros; out[idx[i]] += src[i] for every i (repeated indices accumulate); out is float32.

    An ``out`` without elements is left alone, whatever the indices: a segment sum into no segments checks none
    (as index_add_), and numba types an empty array as C-contiguous, so it would place ``out[idx[i]]`` by the
    shape past the array's memory (a heap block of a few bytes), however its strides read."""
    if not out.size:
        return
    if mode == SERIAL or threads <= 1 and mode == BLOCKS:
        _scatter_serial[0](src, idx, out)
    elif mode == BLOCKS:
        launch(_scatter_blocks, threads, src, idx, out, 4 * threads)
    else:
        order = np.argsort(idx, kind="stable")
        segs, starts = np.unique(idx[order], return_index=True)
        starts = np.append(starts, idx.size).astype(np.int64)
        launch(_scatter_sorted, threads, src, order, starts, segs, out)
