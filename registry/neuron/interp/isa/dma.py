"""``nki.isa`` data movement: DMA copies and transposes, engine copies, the partition shuffle."""

from __future__ import annotations

import numpy as np

from ..constants import dge_mode, engine, oob_mode
from ..dtypes import cast
from ..dynamic import Dynamic
from ..errors import NkiError
from ..state import current
from ..tensor import NkiTensor
from .checks import (
    Dge,
    Engine,
    NkiInstruction,
    Oob,
    floats_of,
    instruction,
    on_chip,
    put,
    same_layout,
    tensor_of,
)

# -- data movement -------------------------------------------------------------------------------------------------


@instruction
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src between HBM and SBUF (either way), SBUF and SBUF, HBM and HBM; never PSUM (nki.isa.dma_copy)."""
    tensor_of("dma_copy", "dst", dst)
    tensor_of("dma_copy", "src", src)
    target = current().target
    for n, t in (("src", src), ("dst", dst)):
        if t.buffer == "psum":
            raise NkiError(f"nisa.dma_copy: {n} {t.describe()} is in PSUM; DMA cannot access PSUM "
                           "(copy it to SBUF with nisa.tensor_copy first)")
        if t.buffer == "sbuf" and t.partitions() > target.partitions:
            raise NkiError(f"nisa.dma_copy: {n} partition dimension {t.partitions()} exceeds maximum 128")
    if dst.size != src.size:
        raise NkiError(f"nisa.dma_copy: dst {list(dst.shape)} and src {list(src.shape)} hold different numbers of "
                       "elements")
    if dge_mode == Dge.hwdge and target.gen < 3:
        raise NkiError(f"nisa.dma_copy: dge_mode=hwdge needs NeuronCore-v3 or newer, not {target.name} (hardware "
                       "DGE, nki.isa.dma_copy)")
    if dge_mode == Dge.hwdge and dst.dtype != src.dtype:
        raise NkiError("nisa.dma_copy: dge_mode=hwdge needs equal dtypes (use .view())")
    vector = [n for n, t in (("src", src), ("dst", dst)) if getattr(t, "vector", False)]
    if vector and not target.indirect_dma:
        raise NkiError(f"nisa.dma_copy: {vector[0]} is an indirect (vector_offset) access, which needs descriptors "
                       f"generated at run time: NeuronCore-v3 or newer (trn2, trn3), not {target.name} (indirect-DMA "
                       "rule; nki.isa.dma_copy, trainium2_arch.rst 'Descriptor Generation Engine')")
    if vector and dge_mode == Dge.hwdge:
        raise NkiError("nisa.dma_copy: hardware DGE does not support indirect DMA (trainium2_arch.rst); use "
                       "dge_mode=swdge or leave it unknown")
    keep = None
    for n, t in (("src", src), ("dst", dst)):
        if isinstance(t, Dynamic) and t.bad_rows().any():
            if oob_mode == Oob.error:
                raise NkiError(f"nisa.dma_copy: {n} access pattern reaches element {t.first_bad()} outside "
                               f"{t.name or 'the tensor'} of {t._flat().size} elements (oob_mode=error: the "
                               "bounds check of dynamic DMA, nki.isa.dma_copy)")
            rows = ~t.bad_rows()  # skip: whole indirect rows are dropped
            if not t.per_row:
                rows = np.repeat(rows, t.shape[0] if t.ndim else 1)
            keep = rows if keep is None else keep & rows
    _copy(dst, src, keep)
    return NkiInstruction()


def _copy(dst: NkiTensor, src: NkiTensor, keep: np.ndarray | None) -> None:
    """dst = src element by element in row-major order of the views, through float32 where the dtypes differ
    (nki.isa.dma_copy); ``keep``: the partitions (rows of the first dim) to move, the rest skipped."""
    if keep is None:
        vals = src.read()
        if src.dtype != dst.dtype:
            vals = vals.astype(np.float32)
        dst.write(vals.reshape(dst.shape))
        return
    if not keep.any():
        return
    p = len(keep)
    vals = _rows(src, keep).reshape(p, -1)
    if src.dtype != dst.dtype:
        vals = vals.astype(np.float32)
    if isinstance(dst, Dynamic) and dst.per_row:
        for i, row in enumerate(dst.rows(keep)):
            if row is not None:
                row[...] = cast(vals[i].reshape(row.shape), dst.dtype)
        dst.storage.dirty = True
        return
    whole = dst.read().reshape(p, -1).copy()
    whole[keep] = cast(vals[keep], dst.dtype)
    dst.write(whole.reshape(dst.shape))


def _rows(t: NkiTensor, keep: np.ndarray) -> np.ndarray:
    """The values of ``t`` as (len(keep), -1), rows not kept left as zeros (never read out of bounds)."""
    p = len(keep)
    if isinstance(t, Dynamic) and t.per_row:
        per = t.size // max(1, p)
        out = np.zeros((p, per), t.read_dtype())
        for i, row in enumerate(t.rows(keep)):
            if row is not None:
                out[i] = row.reshape(-1)
        return out
    if isinstance(t, Dynamic) and t.bad_rows().any():
        return np.zeros((p, t.size // max(1, p)), t.read_dtype())
    return t.read().reshape(p, -1)


@instruction
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    on_chip("tensor_copy", "dst", dst)
    on_chip("tensor_copy", "src", src)
    if engine == Engine.gpsimd and "psum" in (dst.buffer, src.buffer):
        raise NkiError("nisa.tensor_copy: GpSimd cannot access PSUM")
    same_layout("tensor_copy", dst, "dst", src, "src")
    v = src.read() if src.dtype == dst.dtype else floats_of(src)
    put(dst, v)
    return NkiInstruction()


# -- calls the NKI Library uses --------------------------------------------------------------------------------

_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
"""nki.isa.dma_transpose: the permutation by rank, and the only axes supported."""


@instruction
def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """dst = src transposed by the DMA engine (nki.isa.dma_transpose): 2-d (1, 0), 3-d (2, 1, 0), 4-d
    (3, 1, 2, 0); src in HBM or SBUF, dst in SBUF, of the same rank; ``dge_mode=hwdge`` (NeuronCore-v3+) needs
    src.shape[0] == 16, src.shape[-1] % 128 == 0 and a 2-byte dtype."""
    tensor_of("dma_transpose", "dst", dst)
    tensor_of("dma_transpose", "src", src)
    if src.buffer == "psum" or dst.buffer != "sbuf":
        raise NkiError(f"nisa.dma_transpose: src {src.describe()} must be in HBM or SBUF and dst {dst.describe()} in "
                       "SBUF")
    if dst.ndim != src.ndim:
        raise NkiError(f"nisa.dma_transpose: dst rank {dst.ndim} must equal src rank {src.ndim}")
    want = _TRANSPOSE_AXES.get(src.ndim)
    if want is None or (axes is not None and tuple(axes) != want):
        raise NkiError(f"nisa.dma_transpose: axes {axes} of a rank-{src.ndim} src; supported: (1, 0), (2, 1, 0), "
                       "(3, 1, 2, 0)")
    if dge_mode == Dge.hwdge:
        if current().target.gen < 3:
            raise NkiError("nisa.dma_transpose: dge_mode=hwdge needs NeuronCore-v3 or newer")
        if src.shape[0] != 16 or src.shape[-1] % 128 or src.itemsize != 2:
            raise NkiError(f"nisa.dma_transpose: dge_mode=hwdge needs src.shape[0] == 16, src.shape[-1] % 128 == 0 "
                           f"and a 2-byte dtype; src is {list(src.shape)} {src.dtype}")
    shape = tuple(src.shape[a] for a in want)
    if tuple(dst.shape) != shape:
        raise NkiError(f"nisa.dma_transpose: dst {list(dst.shape)} must be {list(shape)} (src {list(src.shape)} "
                       f"transposed by {want})")
    vals = np.transpose(src.read(), want)
    dst.write(vals if src.dtype == dst.dtype else vals.astype(np.float32))
    return NkiInstruction()


@instruction
def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each quadrant of 32 partitions, dst partition i = src partition shuffle_mask[i] (255: dst partition
    left unchanged), on VectorE (nki.isa.nc_stream_shuffle: same dtype and elements per partition)."""
    on_chip("nc_stream_shuffle", "dst", dst)
    on_chip("nc_stream_shuffle", "src", src)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise NkiError(f"nisa.nc_stream_shuffle: shuffle_mask must be 32 partition indices 0-31 (or 255), got {mask}")
    if dst.dtype != src.dtype or dst.per_partition() != src.per_partition():
        raise NkiError(f"nisa.nc_stream_shuffle: dst {list(dst.shape)} {dst.dtype} must have the dtype and the "
                       f"elements per partition of src {list(src.shape)} {src.dtype}")
    p = dst.partitions()
    if p != src.partitions() or (p > 32 and p % 32):
        raise NkiError(f"nisa.nc_stream_shuffle: src and dst access {src.partitions()} and {p} partitions; both the "
                       "same, up to 32 or a multiple of 32")
    vals = src.read().reshape(src.partitions(), -1)
    out = np.array(dst.read()).reshape(p, -1)
    for i in range(p):
        q, j = divmod(i, 32)
        if mask[j] != 255:
            k = q * 32 + mask[j]
            if k >= src.partitions():
                raise NkiError(f"nisa.nc_stream_shuffle: dst partition {i} reads src partition {k}, past the "
                               f"{src.partitions()} accessed")
            out[i] = vals[k]
    dst.write(out.reshape(dst.shape))
    return NkiInstruction()
