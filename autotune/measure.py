"""Measuring in this process: one key's workload, a config's numerics and timing, the final comparison.

``LocalBench`` is what a worker process runs (``worker.IsolatedBench`` sends it requests), and what tests run
in-process with an injected clock. It keeps the current key's compiled compiler and empty regions warm across
trials, and holds a machine-wide lock while it times, so workers sharing a machine never time at the same
moment (compiling still overlaps). After timing, still under the lock, it runs the kernel's region and (once per
key) the compiler's once more, untimed, to measure each one's peak memory (``memory.peak_bytes``).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..registry import Backend, Key, get_op
from .calibration import Calibration
from .inputs import load_samples
from .memory import mib, peak_bytes
from .numerics import check_impl
from .search import TrialResult, first_config
from .timing import Clock, Runner, Workload, calls_to_try, choose_calls, comparison, interleave

LOCK_PATH = os.path.join("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir(), "nki-autotune-measure.lock")
"""One path for every process and user of the machine (not the per-user temporary directory)."""


@contextmanager
def machine_lock(path: str = LOCK_PATH) -> Iterator[None]:
    """Held while timing: one measurement at a time on this machine, whichever process or user runs it."""
    try:
        fd = os.open(path, os.O_RDWR)  # another user's file in sticky /tmp: no O_CREAT (protected_regular)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            os.fchmod(fd, 0o666)  # other users' workers must be able to take it too
        except OSError:
            pass
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@dataclass
class MeasureOptions:
    """What a measurement needs to know of the run's options (picklable: it crosses to the worker)."""

    seed: int = 0
    sets: int = 3
    search_rounds: int = 15
    final_rounds: int = 40
    bench_s: float | None = 3.0
    """A trial's timed rounds stop once they add up to this many seconds (and number ``MIN_ROUNDS``), the final
    comparison's at four times it; None: always the rounds asked."""
    retries: int = 2
    pause_s: float = 5.0
    step_limit_s: float = 60.0
    """One timed step slower than this is a failure of the config (a whole trial has its own time limit)."""


@dataclass
class _Bench:
    workload: Workload
    compiler: Runner
    empty: Runner
    kernels: dict[str, Runner] = field(default_factory=dict)
    compiler_peak: int | None = None
    """Bytes, measured once per key: every kernel of the key is compared with the same compiler region."""


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def region_peak(backend: Backend) -> Callable[[Runner], int]:
    """The peak bytes of one untimed step of a region on ``backend`` (the injected seam, as the clock is)."""
    def peak(runner: Runner) -> int:
        def step() -> None:
            runner.step(0)  # input set 0: its output gradients exist since the region was built
            backend.synchronize()

        return peak_bytes(step, backend.device)

    return peak


class LocalBench:
    def __init__(self, backend: Backend, options: MeasureOptions, clock: Clock | None = None,
                 calibration: Calibration | None = None, lock=machine_lock, say=lambda message: None,
                 peak: Callable[[Runner], int] | None = None):
        self.backend, self.options = backend, options
        self.clock = clock or Clock(backend.synchronize)
        self.peak = peak or region_peak(backend)
        self.calibration = calibration or Calibration(backend, self.clock)
        self.lock, self.say = lock, say
        self._key: Key | None = None
        self._bench: _Bench | None = None
        self._samples: dict | None = None
        self._calibrated = False

    # -- the current key ------------------------------------------------------------------------------------
    def prepare(self, key: Key, samples: str | None = None) -> dict[str, Any]:
        """Build (and compile) ``key``'s workload unless it is the current one; returns the calls per region."""
        if self._key != key or self._bench is None:
            self._bench = None
            self._samples = load_samples(samples) if samples else None
            if not self._calibrated:
                with self.lock():
                    self.calibration.read()  # the first reading sets the bar
                self._calibrated = True
            self._wait_until_quiet()
            w = Workload(get_op(key.op), key, self.backend, sets=self.options.sets, seed=self.options.seed,
                         samples=self._samples)
            with self.lock():
                calls, compiler, empty = choose_calls(w, self.clock)
            self._bench, self._key = _Bench(w, compiler, empty), key
        return {"calls": self._bench.workload.calls}

    def _wait_until_quiet(self) -> None:
        """Between keys: a disturbed calibration reading waits (a few times) for the machine to settle."""
        for _ in range(self.options.retries):
            with self.lock():
                why = self.calibration.disturbed(self.calibration.read())
            if why is None:
                return
            self.say(f"machine disturbed ({why}); waiting {self.options.pause_s:.0f} s")
            time.sleep(self.options.pause_s)

    def _kernel(self, impl_name: str, config: dict[str, int]) -> Runner:
        b = self._bench
        k = f"{impl_name}{sorted(config.items())}"
        if k not in b.kernels:
            b.kernels[k] = b.workload.kernel(get_op(self._key.op).impls[impl_name], config)
        return b.kernels[k]

    def _measure(self, runner: Runner, rounds: int, budget_s: float | None) -> dict[str, Any]:
        """Compiler, kernel and empty region interleaved (the caller holds the machine lock)."""
        b = self._bench
        t = interleave([b.compiler, runner, b.empty], rounds, self.clock, limit_s=self.options.step_limit_s,
                       seed=self.options.seed + rounds, budget_s=budget_s)
        return comparison(t, runner.name, b.workload.calls, seed=self.options.seed)

    def _peaks(self, runner: Runner) -> dict[str, Any]:
        """Each side's peak memory over its region, in MiB (the caller holds the machine lock: the untimed pass
        still loads the machine). A failure to measure it is recorded, never a failed config."""
        b = self._bench
        try:
            if b.compiler_peak is None:
                b.compiler_peak = self.peak(b.compiler)
            if b.compiler_peak == 0:  # the compiler's region makes its outputs: nothing seen is nothing reported
                return {"peak_error": f"no allocation on {self.backend.device} was reported to the profiler"}
            return {"kernel_peak_mib": mib(self.peak(runner)), "compiler_peak_mib": mib(b.compiler_peak)}
        except Exception as e:
            return {"peak_error": f"{type(e).__name__}: {str(e)[:300]}"}

    def precompile(self, key: Key, impl_names: list[str], samples: str | None = None) -> float:
        """Compile ahead, untimed and without the machine lock: ``key``'s compiler and empty regions at every calls
        ``choose_calls`` may try and each impl's first config through the numerics gate, so that
        the timed phase finds them in the compilers' caches (Inductor's and numba's, on disk). Returns the seconds
        it took."""
        t0 = time.perf_counter()
        op = get_op(key.op)
        loaded = load_samples(samples) if samples else None
        w = Workload(op, key, self.backend, sets=self.options.sets, seed=self.options.seed, samples=loaded)
        for calls in calls_to_try(w):
            w.prepare(calls)
            w.compiler(), w.empty()
        gen = torch.Generator().manual_seed(self.options.seed)
        for name in impl_names:
            impl = op.impls[name]
            check_impl(impl, key, first_config(impl, key), gen, self.backend.device, loaded)
        return time.perf_counter() - t0

    def compile_ahead(self, work: list[tuple[Key, list[str], str | None]]) -> dict[Key, float | str]:
        """In one process compiling ahead gains nothing: each key compiles as it comes (``IsolatedBench`` compiles
        ahead on every core)."""
        return {}

    # -- requests ------------------------------------------------------------------------------------------
    def trial(self, key: Key, impl_name: str, config: dict[str, int], samples: str | None = None) -> TrialResult:
        """Numerics of one config against the float64 reference, then its time against the compiler's."""
        info: dict[str, Any] = {}
        try:
            self.prepare(key, samples)
            impl = get_op(key.op).impls[impl_name]
            gen = torch.Generator().manual_seed(self.options.seed + 1000 + len(self._bench.kernels))
            num = check_impl(impl, key, config, gen, self.backend.device, self._samples)
            info.update(rel_err=_sig(num.rel_err, 3) if num.rel_err == num.rel_err else "nan",
                        tolerance=num.tolerance)
            if not num.ok:
                info["error"] = f"numerics: error {num.rel_err:.2e} above {num.tolerance:.0e} ({num.detail})"
                return TrialResult(config, None, info)
            runner = self._kernel(impl_name, config)
            info["compile_s"] = round(runner.compile_s, 3)
            with self.lock():
                m = self._measure(runner, self.options.search_rounds, self.options.bench_s)
                info.update(kernel_us=m["kernel_us"], compiler_us=m["compiler_us"], **self._peaks(runner))
                if "not_measurable" in m:  # a verdict an entry may keep: with the conditions it was reached in
                    reading = self.calibration.read()
                    info["calibration"] = self.calibration.record(reading, None, self.calibration.disturbed(reading))
            if "not_measurable" in m:
                info["region"] = m["region"]
                info["error"] = f"not measurable: {m['not_measurable']}"
                return TrialResult(config, None, info)
            return TrialResult(config, m["speedup"], info)
        except Exception as e:  # a failing config is data, never a crash
            info["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return TrialResult(config, None, info)

    def final(self, key: Key, impl_name: str, config: dict[str, int], samples: str | None = None) -> dict[str, Any]:
        """The final comparison of one config, measured again after a pause while the machine is disturbed during
        it; the result keeps the conditions of the measurement it reports."""
        try:
            self.prepare(key, samples)
            runner = self._kernel(impl_name, config)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        cal = self.calibration
        for attempt in range(self.options.retries + 1):
            with self.lock():
                cal.meter.start()
                m = self._measure(runner, self.options.final_rounds, self.options.bench_s and 4 * self.options.bench_s)
                others = cal.meter.stop()
                reading = cal.read()
            why = cal.disturbed(reading, others)
            m["calibration"] = cal.record(reading, others, why)
            if why is None or attempt == self.options.retries:
                break
            self.say(f"{key.label()}: machine disturbed ({why}); measuring again in {self.options.pause_s:.0f} s")
            time.sleep(self.options.pause_s)
        with self.lock():
            m.update(self._peaks(runner))
        m["compile_s"] = {"kernel": round(runner.compile_s, 3), "compiler": round(self._bench.compiler.compile_s, 3)}
        return m

    def close(self) -> None:
        self._bench = None
