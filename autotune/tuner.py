"""The autotuner: profile -> keys -> trials -> decisions -> table (DESIGN §6)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..registry import Backend, Entry, Impl, Key, Profile, Site, Table, get_op, ops
from .decision import Candidate, decide
from .numerics import check_impl
from .search import Search, TrialResult
from .stats import median, paired_speedup
from .timing import Clock, Runner, Workload, as_us, choose_calls, interleave, per_call


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


class Listener:
    """Progress callbacks; the CLI draws a progress bar from them."""

    def keys(self, n: int) -> None: ...
    def key_started(self, key: Key, sites: list[Site]) -> None: ...
    def trial_done(self, key: Key, impl: Impl, result: TrialResult, best: float | None) -> None: ...
    def key_done(self, key: Key, entry: Entry) -> None: ...


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
                 clock: Clock | None = None, listener: Listener | None = None):
        self.backend, self.search = backend, search
        self.options = options or Options()
        self.clock = clock or Clock(backend.synchronize)
        self.listener = listener or Listener()
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
        specs, attrs = key.inputs, key.attr_dict
        usable, declined = [], []
        for impl in op.impls.values():
            if impl.backend != self.backend.name:
                continue
            why = impl.supports(specs, attrs)
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
        sources = {impl.name: impl.source_hash for impl in usable}
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
        return decide(key, candidates, self.options.threshold, labels, sources, reason)

    def _samples(self, sites: list[Site], profile: Profile | None) -> dict | None:
        for s in sites:
            path = profile.samples_path(s) if profile is not None else None
            if path is not None:
                return torch.load(path, weights_only=True)
        return None

    def _bench(self, key: Key, samples: dict | None) -> _Bench:
        self.measured_anything = True
        op = get_op(key.op)
        w = Workload(op, key, self.backend, sets=self.options.sets, seed=self.options.seed, samples=samples)
        w.prepare(1)
        compiler, empty = w.compiler(), w.empty()
        calls, _ = choose_calls(w, self.clock, compiler, empty)
        if calls > 1:
            w.prepare(calls)
            compiler = w.compiler()
        return _Bench(w, compiler, empty)

    def _kernel(self, b: _Bench, impl: Impl, config: dict[str, int]) -> Runner:
        k = f"{impl.name}{sorted(config.items())}"
        if k not in b.kernels:
            b.kernels[k] = b.workload.kernel(impl, config)
        return b.kernels[k]

    def _measure(self, b: _Bench, runner: Runner, rounds: int) -> dict[str, Any]:
        t = interleave([b.compiler, runner, b.empty], rounds, self.clock, limit_s=self.options.timeout_s)
        calls = b.workload.calls
        c, k = per_call(t["compiler"], t["empty"], calls), per_call(t[runner.name], t["empty"], calls)
        speedup, (lo, hi) = paired_speedup(c, k, seed=self.options.seed)
        return {
            "kernel_us": as_us(median(k)), "compiler_us": as_us(median(c)), "speedup": round(speedup, 3),
            "ci95": [round(lo, 3), round(hi, 3)], "rounds": rounds,
            "region": {"calls": calls, "empty_us": as_us(median(t["empty"]))},
        }

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
            first = results[0]
            return Candidate(impl.name, first.config, {
                "rel_err": min(errs) if errs else None, "tolerance": first.info.get("tolerance"),
                "trials": len(results), "error": first.info.get("error", "")}, numerics_ok=False)
        best = max(ok, key=lambda r: r.speedup)
        final = self.search.final(key, impl)
        if not (final and final.get("config") == best.config and final.get("trials") == len(results)):
            b = get_bench()
            runner = self._kernel(b, impl, best.config)
            m = self._measure(b, runner, self.options.final_rounds)
            final = {
                **m, "rel_err": best.info.get("rel_err"), "tolerance": best.info.get("tolerance"),
                "trials": len(results), "failed": len(results) - len(ok),
                "compile_s": {"kernel": round(runner.compile_s, 3), "compiler": round(b.compiler.compile_s, 3)},
                "config": best.config,
            }
            self.search.save_final(key, impl, final)
        measured = {k: v for k, v in final.items() if k != "config"}
        return Candidate(impl.name, dict(final["config"]), measured, numerics_ok=True)
