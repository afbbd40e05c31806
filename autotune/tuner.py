"""The autotuner: profile -> keys -> trials -> decisions -> table (DESIGN §6)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..registry import Backend, Entry, Impl, Key, Profile, Site, Table, get_op, ops
from .calibration import Calibration
from .decision import Candidate, decide
from .numerics import check_impl
from .search import Search, TrialResult
from .timing import Clock, Runner, Workload, choose_calls, comparison, interleave


@dataclass
class Options:
    trials: int = 16
    threshold: float = 1.05
    seed: int = 0
    budget_s: float | None = None
    search_rounds: int = 15
    final_rounds: int = 40
    sets: int = 3
    timeout_s: float = 60.0
    mode: str | None = None
    ops: tuple[str, ...] | None = None
    retries: int = 2
    """Times a key's final comparison is measured again when the machine was disturbed during it."""
    pause_s: float = 5.0
    """Wait before measuring again on a disturbed machine."""


class Listener:
    """Progress callbacks; the CLI draws a progress bar from them."""

    def keys(self, n: int) -> None: ...
    def key_started(self, key: Key, sites: list[Site]) -> None: ...
    def trial_done(self, key: Key, impl: Impl, result: TrialResult, best: float | None) -> None: ...
    def key_done(self, key: Key, entry: Entry) -> None: ...
    def note(self, message: str) -> None: ...


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


@dataclass
class _Bench:
    """The workload of one key, built only when something must be measured."""

    workload: Workload
    compiler: Runner
    empty: Runner
    kernels: dict[str, Runner] = field(default_factory=dict)


class Tuner:
    def __init__(self, backend: Backend, search: Search, options: Options | None = None,
                 clock: Clock | None = None, listener: Listener | None = None,
                 calibration: Calibration | None = None):
        self.backend, self.search = backend, search
        self.options = options or Options()
        self.clock = clock or Clock(backend.synchronize)
        self.listener = listener or Listener()
        self.calibration = calibration or Calibration(backend, self.clock)
        self.measured_anything = False
        self._deadline = None if self.options.budget_s is None else time.monotonic() + self.options.budget_s

    def over_budget(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    # -- whole profile ------------------------------------------------------------------------------------
    def tune(self, profile: Profile, out: str | Path | None = None) -> Table:
        """Tune every key of ``profile``; the table is rewritten (atomically) after each key."""
        keys = profile.keys(ops(), self.options.mode)
        if self.options.ops is not None:
            keys = {k: v for k, v in keys.items() if k.op in self.options.ops}
        self.listener.keys(len(keys))
        table = Table(self.backend.fingerprint(), [])
        for key, sites in keys.items():
            self.listener.key_started(key, sites)
            entry = self.tune_key(key, sites, profile)
            table.entries.append(entry)
            self.listener.key_done(key, entry)
            if out is not None:
                Table(table.fingerprint, table.entries).save(out)
        return Table(table.fingerprint, table.entries)

    # -- one key ------------------------------------------------------------------------------------------
    def tune_key(self, key: Key, sites: list[Site], profile: Profile | None = None) -> Entry:
        op = get_op(key.op)
        labels = [s.label() for s in sites]
        samples = self._samples(sites, profile)
        usable, declined = [], []
        for impl in op.impls.values():
            if impl.backend != self.backend.name:
                continue
            why = impl.supports(key.inputs, key.attr_dict)
            if why is None and not impl.configs(key):
                why = "its constraint admits no config at this shape"
            (declined.append(f"{impl.qualname} declines: {why}") if why else usable.append(impl))
        if not usable:
            reason = "; ".join(declined) or f"{op.name} has no impl on backend {self.backend.name}"
            return Entry(key, None, sites=labels, reason=f"no kernel to try: {reason}")

        bench: list[_Bench] = []

        def get_bench() -> _Bench:
            if not bench:
                bench.append(self._bench(key, samples))
            return bench[0]

        candidates = []
        for impl in usable:
            results = self.search.run(
                key, impl,
                evaluate=lambda cfg, impl=impl: self._evaluate(get_bench, impl, cfg, samples),
                stop=self.over_budget,
                on_trial=lambda r, impl=impl: self.listener.trial_done(key, impl, r, None),
            )
            cand = self._candidate(key, impl, results, get_bench)
            if cand is not None:
                candidates.append(cand)
        reason = "budget exhausted before any trial ran" if self.over_budget() else ""
        entry = decide(key, candidates, self.options.threshold, labels, {i.name: i for i in usable}, reason)
        if entry.measured:
            entry.measured["calls_per_step"] = sum(s.calls for s in sites)
        return entry

    def _samples(self, sites: list[Site], profile: Profile | None) -> dict | None:
        for s in sites:
            path = profile.samples_path(s) if profile is not None else None
            if path is not None:
                return torch.load(path, weights_only=True)
        return None

    def _bench(self, key: Key, samples: dict | None) -> _Bench:
        if not self.measured_anything:
            self.calibration.read()  # the first, quietest-so-far reading sets the bar
        self.measured_anything = True
        self._wait_until_quiet()
        op = get_op(key.op)
        w = Workload(op, key, self.backend, sets=self.options.sets, seed=self.options.seed, samples=samples)
        calls, compiler, empty = choose_calls(w, self.clock)
        return _Bench(w, compiler, empty)

    def _wait_until_quiet(self) -> None:
        """Between keys: a disturbed calibration reading waits (a few times) for the machine to settle."""
        for _ in range(self.options.retries):
            why = self.calibration.disturbed(self.calibration.read())
            if why is None:
                return
            self.listener.note(f"machine disturbed ({why}); waiting {self.options.pause_s:.0f} s")
            time.sleep(self.options.pause_s)

    def _kernel(self, b: _Bench, impl: Impl, config: dict[str, int]) -> Runner:
        k = f"{impl.name}{sorted(config.items())}"
        if k not in b.kernels:
            b.kernels[k] = b.workload.kernel(impl, config)
        return b.kernels[k]

    def _measure(self, b: _Bench, runner: Runner, rounds: int) -> dict[str, Any]:
        t = interleave([b.compiler, runner, b.empty], rounds, self.clock, limit_s=self.options.timeout_s,
                       seed=self.options.seed + rounds)
        return comparison(t, runner.name, b.workload.calls, seed=self.options.seed)

    def _final(self, b: _Bench, runner: Runner) -> dict[str, Any]:
        """The final comparison, measured again after a pause while the machine is disturbed during it; the
        entry keeps the conditions of the measurement it reports."""
        cal = self.calibration
        for attempt in range(self.options.retries + 1):
            cal.meter.start()
            m = self._measure(b, runner, self.options.final_rounds)
            others = cal.meter.stop()
            reading = cal.read()
            why = cal.disturbed(reading, others)
            m["calibration"] = cal.record(reading, others, why)
            if why is None or attempt == self.options.retries:
                return m
            self.listener.note(f"{b.workload.key.label()}: machine disturbed ({why}); measuring again in "
                               f"{self.options.pause_s:.0f} s")
            time.sleep(self.options.pause_s)
        return m

    def _evaluate(self, get_bench: Callable[[], _Bench], impl: Impl, config: dict[str, int],
                  samples: dict | None) -> TrialResult:
        info: dict[str, Any] = {}
        try:
            b = get_bench()
            key = b.workload.key
            gen = torch.Generator().manual_seed(self.options.seed + 1000 + len(b.kernels))
            num = check_impl(impl, key, config, gen, self.backend.device, samples)
            info.update(rel_err=_sig(num.rel_err, 3) if num.rel_err == num.rel_err else "nan",
                        tolerance=num.tolerance)
            if not num.ok:
                info["error"] = f"numerics: error {num.rel_err:.2e} above {num.tolerance:.0e} ({num.detail})"
                return TrialResult(config, None, info)
            runner = self._kernel(b, impl, config)
            info["compile_s"] = round(runner.compile_s, 3)
            m = self._measure(b, runner, self.options.search_rounds)
            info.update(kernel_us=m["kernel_us"], compiler_us=m["compiler_us"])
            if "not_measurable" in m:
                info["error"] = f"not measurable: {m['not_measurable']}"
                return TrialResult(config, None, info)
            return TrialResult(config, m["speedup"], info)
        except Exception as e:  # a failing config is data, never a crash
            info["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return TrialResult(config, None, info)

    def _candidate(self, key: Key, impl: Impl, results: list[TrialResult],
                   get_bench: Callable[[], _Bench]) -> Candidate | None:
        if not results:
            return None
        ok = [r for r in results if not r.failed]
        if not ok:
            errs = [r.info.get("rel_err") for r in results if isinstance(r.info.get("rel_err"), float)]
            tol = results[0].info.get("tolerance")
            passed = [r for r in results if isinstance(r.info.get("rel_err"), float) and r.info["rel_err"] <= tol]
            first = (passed or results)[0]  # numerics passed but no time: why (e.g. not measurable)
            return Candidate(impl.name, first.config, {
                "rel_err": min(errs) if errs else None, "tolerance": tol,
                "trials": len(results), "error": first.info.get("error", "")}, numerics_ok=bool(passed))
        best = max(ok, key=lambda r: r.speedup)
        final = self.search.final(key, impl)
        if not (final and final.get("config") == best.config and final.get("trials") == len(results)):
            b = get_bench()
            runner = self._kernel(b, impl, best.config)
            m = self._final(b, runner)
            final = {
                **m, "rel_err": best.info.get("rel_err"), "tolerance": best.info.get("tolerance"),
                "trials": len(results), "failed": len(results) - len(ok),
                "compile_s": {"kernel": round(runner.compile_s, 3), "compiler": round(b.compiler.compile_s, 3)},
                "config": best.config,
            }
            self.search.save_final(key, impl, final)
        measured = {k: v for k, v in final.items() if k != "config"}
        return Candidate(impl.name, dict(final["config"]), measured, numerics_ok=True)
