"""What the pack's NKI kernels share: launching (on device, or simulated for numerics), the limits of the
target, and the row gather and one-hot segment matmul that embedding and segment_sum are built from."""

from __future__ import annotations

import torch

from ..registry.nki import nisa, nki, nl
from ..registry.nkisim.state import limits_target

P_MAX = 128
ROWS = (32, 64, 128)


def run(kernel, device: torch.device):
    """On a neuron device the kernel itself; anywhere else its simulation (numerics only)."""
    return kernel if device.type == "neuron" else nki.simulate(kernel)


def fits_sbuf(nbytes: int) -> bool:
    return nbytes <= limits_target().sbuf_partition_bytes


def tiles(n: int, p: int):
    """(start, size) of each tile of p rows over n rows; the last may be short."""
    for t in range((n + p - 1) // p):
        yield t, t * p, min(p, n - t * p)


def gather_rows(table, idx_col, out, p):
    """out[i, :] = table[idx[i], :] by indirect DMA; table HBM [V, F], idx_col HBM [n, 1] int32, out HBM [n, F]."""
    n, f = out.shape
    for _, r0, k in tiles(n, p):
        idx = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx[0:k, :], src=idx_col[r0:r0 + k, :])
        rows = nl.ndarray((p, f), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows[0:k, :], src=table.ap(pattern=[[f, k], [1, f]], offset=0, vector_offset=idx[0:k, :],
                                                    indirect_dim=0))
        nisa.dma_copy(dst=out[r0:r0 + k, :], src=rows[0:k, :])


def segment_matmul(src, idx_col, out, p, chunk):
    """out[s, :] = sum of src[i, :] over the i with idx[i] == s, as one-hot[n, S].T @ src[n, F] on TensorE.

    Duplicate indices are simply summed by the matmul (no read-modify-write races); each block of 128
    output rows and ``chunk`` columns accumulates over the row tiles in one PSUM bank.
    """
    n, f = src.shape
    segs = out.shape[0]
    for s0 in range(0, segs, P_MAX):
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
