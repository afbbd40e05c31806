"""Is the machine quiet enough to trust a measurement?

Two signals. A calibration region of fixed work (compiled like the compiler baseline, so it uses every
thread and slows down under contention the way the compiler's OpenMP code does) is timed at the start and
between keys: a reading well above the quietest one seen, in this run or in the machine's stored quiet reference
(``Search.calibration_reference``: kept in the study storage under the machine's fingerprint, taken on a quiet
machine and replaced by a clearly faster quiet reading, so that load present for a whole run is seen), is drift.
And on Linux, the CPU time that other processes took while we measured (``/proc/stat`` minus this process's own
time, steal time included: a hypervisor that gives our cores to other guests) shows a shared machine directly;
a reading lasts at least ``MIN_WINDOW_S`` so that it is always read. A one-thread kernel hardly notices either,
while the compiler's code collapses: without these checks a busy machine turns into confident, wrong speedups.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Backend
from .stats import median
from .timing import Clock, Runner, fresh

DRIFT = 1.25
"""A calibration reading this many times the quietest one means the machine is disturbed."""
OTHERS = 0.35
"""Cores' worth of CPU taken by other processes while measuring that means the machine is shared."""
MIN_WINDOW_S = 0.5
"""Shortest window whose CPU time is read: ``/proc`` counts in ticks of 10 ms."""
MAX_REPS = 2000
"""Most steps of the calibration region in one reading (about 1 ms each on a quiet machine)."""
REFRESH = 1.1
"""A quiet reading this many times faster than the stored reference replaces it."""


def against_reference(calibration: dict, reference_us: float | None) -> str | None:
    """Why an entry's calibration record (``Calibration.record``) says the machine was disturbed next to the
    machine's stored quiet reference, or None."""
    us = calibration.get("us")
    if reference_us and us and us > DRIFT * reference_us:
        return f"the calibration region took {us / reference_us:.2f}x this machine's quiet reference"
    return None


def quiet(calibration: dict) -> bool:
    """Whether a calibration record was taken on a quiet machine, as the host's own counters tell it (unknown
    counters do not tell it)."""
    others = calibration.get("others_cores")
    return not calibration.get("disturbed") and others is not None and others < OTHERS


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system (idle iowait skipped) irq softirq steal
    return busy / hz, (int(own[11]) + int(own[12])) / hz  # utime + stime


class LoadMeter:
    """Cores' worth of CPU that other processes used between ``start()`` and ``stop()`` (None: unknown)."""

    def __init__(self, read: Callable[[], tuple[float, float] | None] = _cpu_seconds,
                 now: Callable[[], float] = time.monotonic):
        self.read, self.now = read, now
        self._start: tuple[float, tuple[float, float] | None] | None = None

    def start(self) -> None:
        self._start = (self.now(), self.read())

    def short(self) -> bool:
        """Whether the window started is too short to be read yet (False where the counters cannot be read)."""
        return self._start is not None and self._start[1] is not None and self.now() - self._start[0] < MIN_WINDOW_S

    def stop(self) -> float | None:
        t0, c0 = self._start or (self.now(), None)
        c1, wall = self.read(), self.now() - t0
        if c0 is None or c1 is None or wall < MIN_WINDOW_S:  # the counters tick every 10 ms: too coarse below
            return None
        return max(0.0, ((c1[0] - c0[0]) - (c1[1] - c0[1])) / wall)


@dataclass(frozen=True)
class Reading:
    us: float
    """Median time of the calibration region."""
    others: float | None
    """Cores' worth of CPU other processes used during the reading (None: unknown here)."""


class Calibration:
    """The calibration region, its quietest reading so far, and the verdict on new readings."""

    def __init__(self, backend: Backend, clock: Clock, meter: LoadMeter | None = None, reps: int = 9):
        self.backend, self.clock, self.meter, self.reps = backend, clock, meter or LoadMeter(), reps
        self.quietest: float | None = None
        self._runner: Runner | None = None

    def _region(self) -> Runner:
        if self._runner is None:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(192, 192, generator=g).to(self.backend.device)  # ~1 ms on two cores
            b = torch.randn(192, 512, generator=g).to(self.backend.device)
            compiled = self.backend.compile(fresh(lambda a, b: torch.nn.functional.gelu(a @ b).softmax(-1).sum(0)))
            self._runner = Runner("calibration", lambda i: compiled(a, b))
            self._runner.step(0)
        return self._runner

    def read(self) -> Reading:
        runner = self._region()
        self.meter.start()
        times = [self.clock.time(runner, i) for i in range(self.reps)]
        while self.meter.short() and len(times) < MAX_REPS:  # long enough for the CPU counters to mean something
            times.append(self.clock.time(runner, len(times)))
        others = self.meter.stop()
        us = median(times) * 1e6
        if others is None or others < OTHERS:  # only a quiet reading can set the bar
            self.quietest = us if self.quietest is None else min(self.quietest, us)
        return Reading(us, others)

    def disturbed(self, reading: Reading, others: float | None = None) -> str | None:
        """Why ``reading`` (and ``others``, the load seen during a measurement) says the machine is busy."""
        shared = max((x for x in (reading.others, others) if x is not None), default=None)
        if shared is not None and shared >= OTHERS:
            return f"other processes used {shared:.2f} cores while measuring"
        if self.quietest is not None and reading.us > DRIFT * self.quietest:
            return f"the calibration region took {reading.us / self.quietest:.2f}x its quietest time"
        return None

    def record(self, reading: Reading, others: float | None, why: str | None) -> dict:
        """What an entry keeps of the conditions it was measured under."""
        out = {"us": round(reading.us, 1), "quietest_us": round(self.quietest or reading.us, 1)}
        load = max((x for x in (reading.others, others) if x is not None), default=None)
        if load is not None:
            out["others_cores"] = round(load, 2)
        if why:
            out["disturbed"] = why
        return out
