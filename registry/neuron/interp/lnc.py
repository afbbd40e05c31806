"""``nki.lnc`` of the interpreter (NKI 0.8): data exchange and synchronization between the programs of an LNC launch.

Docs (Neuron 2.34): ``LNC`` = nki/api/nki.lnc.rst, ``SR`` = nki/api/generated/nki.lnc.sendrecv.rst, ``SRC`` =
.../nki.lnc.sendrecv_compute.rst, ``CB`` = .../nki.lnc.core_barrier.rst, ``ANN08`` = about-neuron/announcements/
neuron2.x/announce-intent-eos-nki-virtualregister-lnc-apis.rst (``nki.isa.sendrecv``, ``sendrecv_compute`` and
``core_barrier`` are deprecated wrappers of these, warning at the call site; their ``pipe_id`` is ignored).

The programs of a launch run at once (``state.Launch``); the N-th exchange of one program meets the N-th of the
other (SR: "paired across NeuronCore ranks positionally by program order").
"""

from __future__ import annotations

import numpy as np

from .constants import dma_engine, engine
from .errors import NkiError
from .state import current
from .tensor import NkiTensor

_Dma = dma_engine  # the parameter of sendrecv shadows the enum's name
_REDUCE = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum}


def _pair_checks(call: str, src, dst, send_to_rank, recv_from_rank, priority, buffers) -> None:
    from .isa.checks import tensor_of as _tensor  # the engine-operand check (and live-range touch) of nki.isa

    run = current()
    t = run.target
    if t.gen < 3:
        raise NkiError(f"nki.lnc.{call}: available only on NeuronCore-v3 or newer, not {t.name} ({call} docs)")
    if run.lnc != 2:
        raise NkiError(f"nki.lnc.{call}: requires LNC degree 2, the launch has LNC={run.lnc} (nki.lnc: sendrecv and "
                       "sendrecv_compute communicate within a Logical NeuronCore)")
    for name, x in (("src", src), ("dst", dst)):
        _tensor(f"lnc.{call}", name, x)
        if x.buffer not in buffers:
            raise NkiError(f"nki.lnc.{call}: {name} {x.describe()} must be in "
                           f"{' or '.join(b.upper() for b in buffers)} ({call} docs)")
    if src.buffer != dst.buffer:
        raise NkiError(f"nki.lnc.{call}: src in {src.buffer} and dst in {dst.buffer}: both in the same memory")
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise NkiError(f"nki.lnc.{call}: src {list(src.shape)} {src.dtype} and dst {list(dst.shape)} {dst.dtype} must "
                       "have the same shape and dtype")
    for name, r in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r not in (0, 1):
            raise NkiError(f"nki.lnc.{call}: {name}={r!r}; ranks within an LNC of degree 2 are 0 or 1")
    if priority is not None:
        if not isinstance(priority, int) or not 0 <= priority <= 3:
            raise NkiError(f"nki.lnc.{call}: priority={priority!r}; priorities are 0 (highest) to 3 (lowest)")
        if t.gen < 4:
            raise NkiError(f"nki.lnc.{call}: priority needs NeuronCore-v4 or newer, not {t.name} (nki.lnc)")


def _swap(call: str, src: NkiTensor, send_to_rank: int, recv_from_rank: int) -> np.ndarray:
    """Post this program's src and take the tile of ``recv_from_rank``, which must be sending here."""
    run = current()
    parts = run.exchange(call, (np.array(src.read()), int(send_to_rank), int(recv_from_rank)))
    peer = parts[int(recv_from_rank)]
    if peer[1] != run.program_id:
        raise NkiError(f"nki.lnc.{call}: program {run.program_id} receives from rank {recv_from_rank}, which sends "
                       f"to rank {peer[1]}: the pair's send_to_rank and recv_from_rank must match")
    return peer[0]


def sendrecv(src, dst, send_to_rank, recv_from_rank, dma_engine=dma_engine.dma, name=None, priority=None):
    """Send ``src`` to the peer's ``dst`` while receiving the peer's ``src`` into this program's ``dst`` (SR: both
    tiles in SBUF; NeuronCore-v3+, LNC 2; ``priority=None`` with ``dma_engine.gpsimd_dma``)."""
    from .isa.checks import put as _put

    current().memory.tick()
    _pair_checks("sendrecv", src, dst, send_to_rank, recv_from_rank, priority, ("sbuf",))
    if dma_engine == _Dma.gpsimd_dma and priority is not None:
        raise NkiError("nki.lnc.sendrecv: dma_engine=gpsimd_dma takes priority=None (nki.lnc)")
    _put(dst, _swap("sendrecv", src, send_to_rank, recv_from_rank))


def sendrecv_compute(src, dst, send_to_rank, recv_from_rank, reduce_op, name=None, priority=None):
    """dst = reduce_op(src, the peer's src), the exchange and the reduction in one DMA (SRC: nl.add, nl.maximum or
    nl.minimum; both tiles in SBUF or both in private HBM)."""
    from .isa.checks import put as _put

    current().memory.tick()
    _pair_checks("sendrecv_compute", src, dst, send_to_rank, recv_from_rank, priority, ("sbuf", "private_hbm"))
    fn = _REDUCE.get(getattr(reduce_op, "name", ""))
    if fn is None:
        raise NkiError(f"nki.lnc.sendrecv_compute: reduce_op={reduce_op!r}; supported: nl.add, nl.maximum, "
                       "nl.minimum")
    mine = np.asarray(src.read(), np.float32)
    _put(dst, fn(mine, np.asarray(_swap("sendrecv_compute", src, send_to_rank, recv_from_rank), np.float32)))


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Every program waits until all have reached the barrier (CB: NeuronCore-v3+, ``cores=(0, 1)``, ``data`` in
    shared HBM). At LNC=1 the other physical core runs its own launch, which the interpreter does not run: there the
    barrier only checks its arguments."""
    from .isa.checks import tensor_of as _tensor

    run = current()
    run.memory.tick()
    if run.target.gen < 3:
        raise NkiError(f"nki.lnc.core_barrier: available only on NeuronCore-v3 or newer, not {run.target.name}")
    if tuple(cores) != (0, 1):
        raise NkiError(f"nki.lnc.core_barrier: cores={tuple(cores)}; only cores=(0, 1) is supported")
    _tensor("lnc.core_barrier", "data", data)
    if data.buffer != "shared_hbm" and not data.storage.is_input:
        raise NkiError(f"nki.lnc.core_barrier: data {data.describe()} must be in shared HBM, the tensor the cores "
                       "synchronize on")
    if run.lnc == 2:
        run.exchange("core_barrier", None)


__all__ = ["core_barrier", "sendrecv", "sendrecv_compute"]
