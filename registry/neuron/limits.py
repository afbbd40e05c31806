"""The hardware limits of each NKI target, each with the document it comes from.

Docs cited (aws-neuron-sdk, Neuron 2.32/2.33): ``ARCH2`` = nki/guides/architecture/trainium_inferentia2_arch.rst,
``ARCH3`` = .../trainium2_arch.rst, ``ARCH4`` = .../trainium3_arch.rst, ``TS`` = nki.language.tile_size,
``MM`` = nki.isa.nc_matmul, ``DMA`` = nki.isa.dma_copy, ``JIT`` = nki.jit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import platform_target

KIB = 1024
TARGET_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"

SBUF_RESERVED = 16 * KIB
"""TS: the usable SBUF per partition (``sbuf_fmax_bytes``, ``total_available_sbuf_size``) is "total minus reserved
bytes". The docs do not give the reserve to the byte; 16 KiB is the reserve of the usable sizes reported on real
trn2 (208 of 224 KiB) and trn3 (240 of 256 KiB) hosts, applied to every target."""


class TargetError(ValueError):
    """A target name that is not one of the NKI targets."""


@dataclass(frozen=True)
class Target:
    name: str
    gen: int
    """The NeuronCore version: 2 (trn1), 3 (trn2), 4 (trn3)."""
    sbuf_physical_bytes: int
    """SBUF bytes per partition: ARCH2 24 MiB = 128 x 192 KiB; ARCH3 28 MiB = 128 x 224 KiB; ARCH4 32 MiB."""
    psum_partition_bytes: int = 16 * KIB
    """ARCH2/ARCH3/ARCH4: PSUM is 2 MiB = 128 partitions x 16 KiB on every target."""
    psum_bank_bytes: int = 2 * KIB
    """ARCH2 "Near-memory accumulation in PSUM": 8 banks of 2 KiB (512 float32) per partition."""
    partitions: int = 128
    """ARCH2: SBUF and PSUM have 128 partitions; TS ``pmax``."""
    matmul_k: int = 128
    matmul_m: int = 128
    """MM: contraction K and stationary free size M at most 128 (TS ``gemm_stationary_fmax``)."""
    matmul_n_fp32: int = 512
    matmul_n_bf16: int = 512
    """MM: moving free size N at most 512 on NeuronCore-v2/v3 (one PSUM bank of float32); v4: 4096 for a float32
    dst, 8192 for a bfloat16 dst."""

    @property
    def sbuf_partition_bytes(self) -> int:
        """Usable SBUF bytes per partition (TS ``sbuf_fmax_bytes``): the physical size minus the reserve."""
        return self.sbuf_physical_bytes - SBUF_RESERVED

    @property
    def indirect_dma(self) -> bool:
        """DMA: a gather or scatter with dynamic indices (``vector_offset``) needs descriptors generated at run time
        by a Descriptor Generation Engine, which ARCH3 introduces with NeuronCore-v3 ("DGE")."""
        return self.gen >= 3


TARGETS = {
    "trn1": Target("trn1", 2, 192 * KIB),
    "trn2": Target("trn2", 3, 224 * KIB),
    "trn3": Target("trn3", 4, 256 * KIB, matmul_n_fp32=4096, matmul_n_bf16=8192),
}
ALIASES = {"inf2": "trn1", "gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}
"""JIT: NEURON_PLATFORM_TARGET_OVERRIDE takes trn1|inf2|gen2, trn2|gen3, trn3|gen4."""


def target_named(raw: str, where: str = TARGET_VAR) -> Target:
    name = ALIASES.get(raw.strip().lower(), raw.strip().lower())
    if name not in TARGETS:
        raise TargetError(f"{where}={raw!r} is not a target; use trn1, trn2, trn3 (or gen2, gen3, gen4)")
    return TARGETS[name]


def _named() -> Target | None:
    """The target named by NEURON_PLATFORM_TARGET_OVERRIDE, else the one TorchNeuron detects, else None."""
    raw = os.environ.get(TARGET_VAR, "").strip()
    if raw:
        return target_named(raw)
    detected = platform_target()
    return target_named(detected, "TorchNeuron's platform target") if detected else None


def simulated_target() -> Target:
    """The simulator's target (docs: nki/guides/nki_simulator.rst): the named or detected one, else trn3. Read
    where the real simulator reads it, at each launch."""
    return _named() or TARGETS["trn3"]


def limits_target() -> Target:
    """The limits kernels must respect: the named or detected target, else trn2's (which hold on trn2 and trn3)."""
    return _named() or TARGETS["trn2"]
