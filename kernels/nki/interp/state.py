"""The interpreter's run state: the target, the launch (program id, LNC), on-chip memory and engine registers."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ..limits import Target, simulated_target
from .errors import NkiError
from .memory import Memory


@dataclass
class Run:
    """One program of a kernel launch."""

    target: Target
    lnc: int = 1
    program_id: int = 0
    shared: list = field(default_factory=list)
    shared_next: int = 0
    memory: Memory = None  # type: ignore[assignment]
    act_acc: np.ndarray = field(default_factory=lambda: np.full(128, np.nan, np.float32))
    """The ScalarE accumulator: one float32 per lane, undefined until a reduce_cmd resets it (nki.isa.activation,
    "Accumulator behavior")."""
    act_defined: np.ndarray = field(default_factory=lambda: np.zeros(128, bool))
    instruction: str = ""

    def __post_init__(self) -> None:
        if self.memory is None:
            self.memory = Memory(self.target)

    def shared_alloc(self, make):
        """Shared HBM is one tensor for every program of an LNC launch: the k-th allocation of each program."""
        if self.program_id == 0:
            t = make()
            self.shared.append(t)
            return t
        if self.shared_next >= len(self.shared):
            raise NkiError("program 1 allocated more shared_hbm tensors than program 0: all programs of an LNC "
                           "launch must run the same control flow (docs: nki/get-started/about/lnc.rst)")
        t = self.shared[self.shared_next]
        self.shared_next += 1
        return t


_local = threading.local()


def current() -> Run:
    run = getattr(_local, "run", None)
    if run is None:  # outside a launch (e.g. building tiles in a test): the default target
        run = _local.run = Run(simulated_target())
    return run


def enter(run: Run) -> Run | None:
    prev = getattr(_local, "run", None)
    _local.run = run
    return prev


def leave(prev: Run | None) -> None:
    _local.run = prev
