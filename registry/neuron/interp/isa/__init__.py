"""``nki.isa`` of the interpreter: dst-first engine calls with their documented semantics and limits, one module
per engine (``dma``, ``compute``, ``matmul``, ``scalars``) over the checks they share (``checks``).

Engines compute in float32 and cast to the destination dtype (docs: nki.isa, each call's "Data types"); int32
``tensor_tensor`` runs on GpSimd in exact integer arithmetic. Each call checks the partition limit and start
(``ARCH2`` = nki/guides/architecture/trainium_inferentia2_arch.rst, "Data streaming"), the buffers its engine may
read and write, and the shape rules, names itself and the rule in any error, and counts as one instruction of the
program for the live ranges of on-chip memory.
"""

from __future__ import annotations

from .. import constants
from ..constants import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd
from ..scalar import NkiScalar, VirtualRegister
from .checks import (
    NkiInstruction,
    get_nc_version,
    gpsimd_engine,
    scalar_engine,
    sync_engine,
    tensor_engine,
    vector_engine,
)
from .compute import (
    activation,
    activation_reduce,
    affine_select,
    iota,
    memset,
    range_select,
    reciprocal,
    scalar_tensor_tensor,
    tensor_partition_reduce,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_reduce,
    tensor_tensor,
)
from .dma import dma_copy, dma_transpose, nc_stream_shuffle, tensor_copy
from .matmul import nc_matmul, nc_transpose
from .scalars import (
    core_barrier,
    register_alloc,
    register_load,
    register_move,
    register_store,
    scalar_load,
    scalar_store,
    sendrecv,
    sendrecv_compute,
)

__all__ = [
    "NkiInstruction", "NkiScalar", "VirtualRegister", "activation", "activation_reduce", "affine_select",
    "constants", "core_barrier", "dge_mode", "dma_copy", "dma_engine", "dma_transpose", "engine", "get_nc_version",
    "gpsimd_engine", "iota",
    "matmul_perf_mode", "memset", "nc_matmul", "nc_stream_shuffle", "nc_transpose", "nc_version", "oob_mode",
    "range_select", "reciprocal", "reduce_cmd", "register_alloc", "register_load", "register_move", "register_store",
    "scalar_engine", "scalar_load", "scalar_store", "scalar_tensor_tensor", "sendrecv", "sendrecv_compute",
    "sync_engine", "tensor_copy", "tensor_engine", "tensor_partition_reduce", "tensor_reduce", "tensor_scalar",
    "tensor_scalar_reduce", "tensor_tensor", "vector_engine",
]
