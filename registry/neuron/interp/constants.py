"""``nki.isa.constants`` of the interpreter: the enums the ``nki.isa`` calls take (also exported by ``nki.isa``)."""

from __future__ import annotations

from enum import Enum, IntEnum


class engine(Enum):  # noqa: N801  (the NKI names)
    unknown = 0
    tensor = 1
    vector = 2
    scalar = 3
    gpsimd = 4
    dma = 5
    sync = 6


class reduce_cmd(Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class oob_mode(Enum):  # noqa: N801
    error = 0
    skip = 1


class dge_mode(Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class matmul_perf_mode(Enum):  # noqa: N801
    none = 0
    double_row = 1


class nc_version(IntEnum):  # noqa: N801
    """Ordered, as the NKI Library compares it (``get_nc_version() >= nc_version.gen3``)."""

    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(Enum):  # noqa: N801
    """Which DMA queue moves the data (nki.lnc.sendrecv's ``dma_engine``)."""

    dma = 0
    gpsimd_dma = 1
