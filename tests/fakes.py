"""Fakes for the tuner's seams (compiler, clock, load meter) and the tuner built on them.

Plain module: the multi-worker tests also run it in their own processes (``tests/data/fake_worker.py``).
"""

from __future__ import annotations

import contextlib

from nki_autotune.autotune.calibration import Calibration, LoadMeter
from nki_autotune.autotune.measure import LocalBench
from nki_autotune.autotune.search import Search, open_storage
from nki_autotune.autotune.timing import Clock
from nki_autotune.autotune.tuner import Options, Tuner
from nki_autotune.registry import Site, TensorSpec
from nki_autotune.registry.cpu import CpuBackend


class EagerCpu(CpuBackend):
    """The cpu backend with torch.compile replaced by eager calls: the tuner's logic without compile time."""

    def compile(self, fn):
        return fn


class FakeClock(Clock):
    """Time of one region step from a formula of the runner: the tuner's decisions become predictable."""

    def __init__(self, kernel_us, compiler_us=100.0, empty_us=10.0, calibration_us=1000.0):
        super().__init__(sync=lambda: None)
        self.kernel_us, self.compiler_us, self.empty_us = kernel_us, compiler_us, empty_us
        self.calibration_us = calibration_us
        self.calls = 0

    def time(self, runner, i):
        if runner.name == "calibration":  # fixed work: no need to run it again
            us = self.calibration_us
            return (us(i) if callable(us) else us) * 1e-6  # a callable: the time of step i of a reading
        runner.step(i)  # still run it: failures must surface as they would
        self.calls += 1
        if runner.name == "empty":
            us = self.empty_us
        elif runner.name == "compiler":
            us = self.compiler_us
        else:
            us = self.kernel_us(runner.config)
        return (us + 0.5 * ((i * 7919) % 5)) * 1e-6


class QuietMeter(LoadMeter):
    """No other process uses the CPU (or, with ``busy``, the given cores' worth while the tuner measures)."""

    def __init__(self, busy=()):
        super().__init__(read=lambda: None)
        self.busy = list(busy)

    def stop(self):
        return self.busy.pop(0) if self.busy else 0.0


def site(shape=(64, 128), dtype="float32", grad=True, label="model.norm"):
    specs = (TensorSpec(shape, dtype, requires_grad=grad), TensorSpec(shape[-1:], dtype, requires_grad=grad))
    return Site("rmsnorm", specs, {"eps": 1e-6}, label)


def local(be, options, clock, meter=None, peak=None):
    """Measurement in this process with the injected clock, load meter and (given) peak memory, and no machine-wide
    lock."""
    return LocalBench(be, options.measure(), clock=clock, calibration=Calibration(be, clock, meter or QuietMeter()),
                      lock=contextlib.nullcontext, peak=peak)


def tuner(tmp_path, clock, trials=20, meter=None, storage=None, peak=None, **kw):
    be = EagerCpu()
    search = Search(open_storage(storage or f"sqlite:///{tmp_path}/studies.db"), be.fingerprint(), trials=trials)
    options = Options(trials=trials, search_rounds=5, final_rounds=12, sets=2, pause_s=0, poll_s=0.05, **kw)
    return Tuner(be, search, local(be, options, clock, meter, peak), options)


def fast_when(threads=2, rows=16, us=40.0, other=90.0):
    return lambda cfg: us if (cfg["threads"], cfg["rows_per_task"]) == (threads, rows) else other
