"""Is the machine quiet enough to trust a measurement?

Two signals. A calibration region of fixed work (compiled like the compiler baseline, so it uses every
thread and slows down under contention the way the compiler's OpenMP code does) is timed at the start and
between keys: a reading well above the machine's typical quiet one, in this run (the median of its quiet readings)
or in its stored quiet reference (``Search.calibration_reference``: kept in the study storage under the machine's
fingerprint, a run's typical quiet reading, replaced by a clearly faster one, so that load present for a whole run
is seen), is drift. A reading is the mean time of a step over its window, not the median: a step that loses its
core to another process for a time slice is what contention costs, and the median of a window hides it.
Measured on a 2-vCPU guest with nothing else running (90 readings), readings spread from 0.75x to 1.45x their
median, so the quietest of a run was no bar (most readings were 1.25x of it); with a process spinning on one core,
the mean was 2.8-7.7x the quiet median while the median step moved 1.17x. ``DRIFT`` lies between the two.
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

DRIFT = 2.0
"""A calibration reading this many times the typical quiet one means the machine is disturbed."""
TYPICAL_AFTER = 3
"""Quiet readings of a run before their median is offered as the machine's stored reference."""
OTHERS = 0.35
"""Cores' worth of CPU taken by other processes while measuring that means the machine is shared."""
MIN_WINDOW_S = 0.5
"""Shortest window whose CPU time is read: ``/proc`` counts in ticks of 10 ms."""
MAX_REPS = 2000
"""Most steps of the calibration region in one reading (about 1 ms each on a quiet machine)."""
REFRESH = 1.1
"""A run's typical quiet reading this many times faster than the stored reference replaces it."""


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
    """Mean time of a step of the calibration region over the reading's window."""
    others: float | None
    """Cores' worth of CPU other processes used during the reading (None: unknown here)."""
    drift: str | None = None
    """Why the reading is well above the run's typical quiet one before it (None: it is not)."""


class Calibration:
    """The calibration region, its quiet readings so far, and the verdict on new readings."""

    def __init__(self, backend: Backend, clock: Clock, meter: LoadMeter | None = None, reps: int = 9):
        self.backend, self.clock, self.meter, self.reps = backend, clock, meter or LoadMeter(), reps
        self.quiet_us: list[float] = []
        self._runner: Runner | None = None

    @property
    def typical(self) -> float | None:
        """The median of this run's quiet readings (None before the first)."""
        return median(self.quiet_us) if self.quiet_us else None

    def _region(self) -> Runner:
        if self._runner is None:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(192, 192, generator=g).to(self.backend.device)  # ~1 ms on two cores
            b = torch.randn(192, 512, generator=g).to(self.backend.device)
            compiled = self.backend.compile(fresh(lambda a, b: torch.nn.functional.gelu(a @ b).softmax(-1).sum(0)))
            self._runner = Runner("calibration", lambda i: compiled(a, b))
            for i in range(3):  # compiled, then warm: a reading is a mean, and a cold first step would weigh in it
                self._runner.step(i)
        return self._runner

    def read(self) -> Reading:
        runner = self._region()
        self.meter.start()
        times = [self.clock.time(runner, i) for i in range(self.reps)]
        while self.meter.short() and len(times) < MAX_REPS:  # long enough for the CPU counters to mean something
            times.append(self.clock.time(runner, len(times)))
        others = self.meter.stop()
        us = sum(times) / len(times) * 1e6
        typical, drift = self.typical, None
        if typical is not None and us > DRIFT * typical:
            drift = f"the calibration region took {us / typical:.2f}x this run's typical quiet time"
        elif others is None or others < OTHERS:  # only a quiet reading sets the bar
            self.quiet_us.append(us)
        return Reading(us, others, drift)

    def disturbed(self, reading: Reading, others: float | None = None) -> str | None:
        """Why ``reading`` (and ``others``, the load seen during a measurement) says the machine is busy."""
        shared = max((x for x in (reading.others, others) if x is not None), default=None)
        if shared is not None and shared >= OTHERS:
            return f"other processes used {shared:.2f} cores while measuring"
        return reading.drift

    def record(self, reading: Reading, others: float | None, why: str | None) -> dict:
        """What an entry keeps of the conditions it was measured under."""
        out: dict = {"us": round(reading.us, 1)}
        if self.typical is not None:
            out["typical_us"] = round(self.typical, 1)
        if len(self.quiet_us) >= TYPICAL_AFTER:
            out["quiet_readings"] = len(self.quiet_us)
        load = max((x for x in (reading.others, others) if x is not None), default=None)
        if load is not None:
            out["others_cores"] = round(load, 2)
        if why:
            out["disturbed"] = why
        return out
