"""The interpreter's run state: the target, the launch (program id, LNC), on-chip memory and engine registers.

The programs of an LNC launch run at once, one thread each, so that they can exchange data while running
(``nki.lnc.sendrecv``, ``core_barrier``): each program has its own ``Run`` (thread-local), and the ``Launch`` they
share holds the shared-HBM tensors and the rendezvous of their exchanges.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ..limits import Target, simulated_target
from .errors import NkiError
from .memory import Memory

EXCHANGE_TIMEOUT_S = 600.0
"""How long a program waits at an exchange for its peer before the launch is declared stuck."""


class Launch:
    """What the programs of one launch share: shared-HBM allocations (the k-th of each program is one tensor) and
    exchanges, paired by program order (nki.lnc.sendrecv: "the Nth sendrecv on one rank rendezvous with the Nth
    sendrecv on the peer rank")."""

    def __init__(self, lnc: int):
        self.lnc = lnc
        self.shared: list = []
        self.lock = threading.Condition()
        self.slots: list[dict] = []
        self.ended: set[int] = set()

    def shared_alloc(self, k: int, make, shape, dtype):
        with self.lock:
            if k == len(self.shared):
                self.shared.append(make())
            t = self.shared[k]
        if tuple(t.shape) != tuple(int(s) for s in shape) or t.dtype != str(dtype):
            raise NkiError(f"shared_hbm allocation {k} is {list(t.shape)} {t.dtype} in one program and "
                           f"{list(shape)} {dtype} in another: all programs of an LNC launch must run the same "
                           "control flow (docs: nki/get-started/about/lnc.rst)")
        return t

    def exchange(self, pid: int, k: int, call: str, post) -> dict:
        """Post this program's part of its k-th exchange and wait for every program's; returns them by program."""
        with self.lock:
            while len(self.slots) <= k:
                self.slots.append({})
            slot = self.slots[k]
            slot[pid] = (call, post)
            self.lock.notify_all()
            ok = self.lock.wait_for(lambda: len(slot) == self.lnc or self.ended - set(slot),
                                    timeout=EXCHANGE_TIMEOUT_S)
            if len(slot) < self.lnc:
                gone = sorted(self.ended - set(slot))
                why = (f"program {gone[0]} ended without it" if ok and gone else
                       f"no other program reached it within {EXCHANGE_TIMEOUT_S:.0f} s")
                raise NkiError(f"{call}: program {pid} waits at its exchange number {k + 1} (sendrecv/core_barrier, "
                               f"paired by program order) but {why}: all programs of an LNC launch must make the "
                               "same exchanges in the same order (nki.lnc.sendrecv)")
            calls = {c for c, _ in slot.values()}
            if len(calls) > 1:
                raise NkiError(f"exchange number {k + 1} pairs {' with '.join(sorted(calls))}: the programs of an LNC "
                               "launch must make the same exchanges in the same order")
            return {p: v for p, (_, v) in slot.items()}

    def end(self, pid: int) -> None:
        with self.lock:
            self.ended.add(pid)
            self.lock.notify_all()


@dataclass
class Run:
    """One program of a kernel launch."""

    target: Target
    lnc: int = 1
    program_id: int = 0
    launch: Launch = None  # type: ignore[assignment]
    shared_next: int = 0
    exchanges: int = 0
    memory: Memory = None  # type: ignore[assignment]
    act_acc: np.ndarray = field(default_factory=lambda: np.full(128, np.nan, np.float32))
    """The ScalarE accumulator: one float32 per lane, undefined until a reduce_cmd resets it (nki.isa.activation,
    "Accumulator behavior")."""
    act_defined: np.ndarray = field(default_factory=lambda: np.zeros(128, bool))
    instruction: str = ""
    no_reorder: int = 0
    """Depth of ``nl.no_reorder()`` blocks."""

    def __post_init__(self) -> None:
        if self.memory is None:
            self.memory = Memory(self.target)
        if self.launch is None:
            self.launch = Launch(self.lnc)

    def shared_alloc(self, make, shape, dtype):
        """Shared HBM is one tensor for every program of an LNC launch: the k-th allocation of each program."""
        k = self.shared_next
        self.shared_next += 1
        return self.launch.shared_alloc(k, make, shape, dtype)

    def exchange(self, call: str, post) -> dict:
        k = self.exchanges
        self.exchanges += 1
        if self.lnc == 1:
            return {0: post}
        return self.launch.exchange(self.program_id, k, call, post)


_local = threading.local()


def current() -> Run:
    run = getattr(_local, "run", None)
    if run is None:  # outside a launch (e.g. building tiles in a test): the default target
        run = _local.run = Run(simulated_target())
    return run


def active() -> bool:
    """Whether a launch is running on this thread (a jit kernel called inside one is inlined, not launched)."""
    return getattr(_local, "run", None) is not None and getattr(_local, "launched", False)


def enter(run: Run) -> Run | None:
    prev = getattr(_local, "run", None), getattr(_local, "launched", False)
    _local.run, _local.launched = run, True
    return prev


def leave(prev) -> None:
    _local.run, _local.launched = prev
