"""The autotuner: profile -> keys -> trials -> decisions -> table (docs/design.md §6).

The tuner only coordinates: it claims work through the study storage (``search``), has a bench measure it
(``measure.LocalBench`` in this process, or ``worker.IsolatedBench`` in a worker process), and decides from
what the storage holds. So several tuners on one storage share the work, and each writes the same table.
A key whose trials or final comparison another worker is still measuring is left for later; the tuner
comes back to it, and waits only when no other key has work left.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..registry import Backend, Entry, Impl, Key, Profile, Site, Table, get_op, ops
from .calibration import against_reference, quiet
from .decision import Candidate, best_trial, decide
from .inputs import load_samples
from .measure import MeasureOptions
from .search import Search, TrialResult, handlers


@dataclass
class Options:
    trials: int = 16
    threshold: float = 1.05
    objective: str = "time"
    """What a kernel must improve to be enabled: ``time`` or ``memory`` (``decision``)."""
    seed: int = 0
    budget_s: float | None = None
    search_rounds: int = 15
    final_rounds: int = 40
    bench_s: float | None = 3.0
    """Seconds after which a trial's rounds stop (``MeasureOptions.bench_s``)."""
    sets: int = 3
    mode: str | None = None
    ops: tuple[str, ...] | None = None
    retries: int = 2
    """Times a key's final comparison is measured again when the machine was disturbed during it."""
    pause_s: float = 5.0
    """Wait before measuring again on a disturbed machine."""
    poll_s: float = 2.0
    """Wait between looks at the storage while other workers finish the last keys."""

    def measure(self) -> MeasureOptions:
        fields = MeasureOptions.__dataclass_fields__
        return MeasureOptions(**{k: v for k, v in asdict(self).items() if k in fields})


class Bench(Protocol):
    """Measures for the tuner: ``measure.LocalBench`` or ``worker.IsolatedBench``."""

    def trial(self, key: Key, impl: str, config: dict[str, int], samples: str | None = None) -> TrialResult: ...
    def compile_ahead(self, work: list[tuple[Key, list[str], str | None]]) -> dict[Key, float | str]: ...
    def final(self, key: Key, impl: str, config: dict[str, int], samples: str | None = None) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Listener:
    """Progress callbacks; the CLI draws a progress bar from them."""

    def keys(self, n: int) -> None: ...
    def key_started(self, key: Key, sites: list[Site]) -> None: ...
    def trial_done(self, key: Key, impl: Impl, result: TrialResult) -> None: ...
    def key_done(self, key: Key, entry: Entry) -> None: ...
    def note(self, message: str) -> None: ...


def _inputs_note(sites: list[Site], profile: Profile | None) -> str:
    """Where a data-dependent op's timed inputs came from, for the entry."""
    if profile is not None and any(profile.samples_path(s) is not None for s in sites):
        return "recorded samples"
    summary = next((s.summary for s in sites if s.summary), None)
    if summary:
        said = ", ".join(f"{k} {v:g}" for k, v in summary.items())
        return f"no samples were kept: inputs drawn to match the recorded {said}"
    return "no samples were kept: inputs drawn by the op's make_inputs"


class Tuner:
    def __init__(self, backend: Backend, search: Search, bench: Bench, options: Options | None = None,
                 listener: Listener | None = None):
        self.backend, self.search, self.bench = backend, search, bench
        self.options = options or Options()
        self.listener = listener or Listener()
        self.measured_anything = False
        self.reference: float | None = None
        """The calibration region's time on this machine when quiet, from the storage (``calibration``)."""
        self._deadline = None if self.options.budget_s is None else time.monotonic() + self.options.budget_s
        self._summaries: tempfile.TemporaryDirectory | None = None

    def over_budget(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    # -- whole profile ------------------------------------------------------------------------------------
    def tune(self, profile: Profile) -> Table:
        """Tune every key of ``profile``. The table comes once every key is complete: storage keeps what an
        interrupted run measured, and the table it would replace stays whole until then."""
        keys = profile.keys(ops(), self.options.mode)
        if self.options.ops is not None:
            keys = {k: v for k, v in keys.items() if k.op in self.options.ops}
        for sites in keys.values():  # before any trial: a bad file is bad input, not a failed config
            path = self._samples(sites, profile)
            if path is not None:
                load_samples(path)
        self.listener.keys(len(keys))
        self._compile_ahead(keys, profile)
        self.reference = self.search.calibration_reference()
        fingerprint = self.backend.fingerprint()
        entries: dict[Key, Entry] = {}
        started: set[Key] = set()
        while len(entries) < len(keys):
            before = self.measured_anything
            for key, sites in keys.items():
                if key in entries:
                    continue
                if key not in started:
                    started.add(key)
                    self.listener.key_started(key, sites)
                entry = self.tune_key(key, sites, profile)
                if entry is not None:
                    entries[key] = entry
                    self.listener.key_done(key, entry)
            if len(entries) < len(keys) and self.measured_anything == before:
                self.listener.note(f"waiting for other workers on {len(keys) - len(entries)} key(s)")
                time.sleep(self.options.poll_s)
        return Table(fingerprint, [entries[k] for k in keys])

    def _compile_ahead(self, keys: dict[Key, list[Site]], profile: Profile) -> None:
        """Before any key is timed, the bench compiles the regions of every key whose studies still need work, on
        every core (Inductor's compile of the compiler's regions and numba's of the kernels are most of a cold
        key's time, and one key's compile would otherwise wait for the previous key's timing)."""
        work = []
        for key, sites in keys.items():
            usable = self._usable(key)[0]
            if any(not self.search.settled(key, impl) for impl in usable):
                work.append((key, [impl.name for impl in usable], self._samples(sites, profile)))
        if work:
            self.listener.note(f"compiling {len(work)} key(s) ahead of timing")
            t0 = time.monotonic()
            failed = sum(isinstance(v, str) for v in self.bench.compile_ahead(work).values())
            self.listener.note(f"compiled {len(work)} key(s) ahead in {time.monotonic() - t0:.0f} s"
                               + (f" ({failed} failed: their trials will say why)" if failed else ""))

    def _usable(self, key: Key) -> tuple[list[Impl], list[str]]:
        """The impls of ``key``'s op on this backend that take it, and why each other one declines."""
        usable, declined = [], []
        for impl in get_op(key.op).impls.values():
            if impl.backend != self.backend.name:
                continue
            why = impl.supports(key.inputs, key.attr_dict)
            if why is None and not impl.configs(key):
                why = "its constraint admits no config at this shape"
            (declined.append(f"{impl.qualname} declines: {why}") if why else usable.append(impl))
        return usable, declined

    # -- one key ------------------------------------------------------------------------------------------
    def tune_key(self, key: Key, sites: list[Site], profile: Profile | None = None) -> Entry | None:
        """The key's entry, or None while other workers still measure some of its work."""
        op = get_op(key.op)
        labels = [s.label() for s in sites]
        samples = self._samples(sites, profile)
        usable, declined = self._usable(key)
        if not usable:
            reason = "; ".join(declined) or f"{op.name} has no impl on backend {self.backend.name}"
            return Entry(key, None, sites=labels, reason=f"no kernel to try: {reason}")

        candidates, waiting, tried = [], False, False
        for impl in usable:
            work = self._work(key, impl, samples)
            results, complete = self.search.run(key, impl, work, stop=self.over_budget,
                                                on_trial=lambda r, impl=impl: self.listener.trial_done(key, impl, r))
            tried = tried or bool(results)
            if not complete and not self.over_budget():
                waiting = True
                continue
            cand = self._candidate(key, impl, results, work)
            if cand is None and results and any(not r.failed for r in results) and not self.over_budget():
                waiting = True  # its final comparison is being measured elsewhere
            elif cand is not None:
                candidates.append(cand)
        if waiting:
            return None
        reason = ""
        if self.over_budget() and not candidates:
            reason = ("budget exhausted before a final comparison was measured" if tried
                      else "budget exhausted before any trial ran")
        entry = decide(key, candidates, self.options.threshold, labels, {i.name: i for i in usable}, reason,
                       self.options.objective)
        if entry.measured:
            entry.measured["calls_per_step"] = sum(s.calls for s in sites)
            if op.data_dependent:
                entry.measured["inputs"] = _inputs_note(sites, profile)
        return entry

    def _samples(self, sites: list[Site], profile: Profile | None) -> str | None:
        """The sites' recorded inputs; else, where the profile recorded a summary of them (``Op.summary``), a file
        holding ``{"summary": ...}`` for ``make_inputs`` to draw inputs alike; else None."""
        for s in sites:
            path = profile.samples_path(s) if profile is not None else None
            if path is not None:
                return str(path.resolve())
        summary = next((s.summary for s in sites if s.summary), None)
        if summary is None:
            return None
        if self._summaries is None:
            self._summaries = tempfile.TemporaryDirectory(prefix="nki-autotune-summaries-")
        digest = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(self._summaries.name) / f"{digest}.pt"
        if not path.exists():
            torch.save({"summary": dict(summary)}, path)
        return str(path)

    def _work(self, key: Key, impl: Impl, samples: str | None) -> dict:
        """What this tuner does with a claimed trial of ``impl`` at ``key``: the bench measures it."""
        def evaluate(cfg: dict[str, int]) -> TrialResult:
            self.measured_anything = True
            return self.bench.trial(key, impl.name, cfg, samples)

        def measure(cfg: dict[str, int]) -> dict[str, Any]:
            self.measured_anything = True
            return self._judged(self.bench.final(key, impl.name, cfg, samples))

        return handlers(evaluate, measure)

    def _judged(self, final: dict[str, Any]) -> dict[str, Any]:
        """``final`` with its calibration compared with the machine's stored quiet reference as well (before it is
        stored: a disturbed final comparison is measured again by the next run); from a quiet one, the run's typical
        quiet reading becomes the reference where it is clearly faster."""
        cal = final.get("calibration")
        if not isinstance(cal, dict):
            return final
        why = cal.get("disturbed") or against_reference(cal, self.reference)
        if why:
            cal["disturbed"] = why
        cal["reference_us"] = self.reference  # None: no quiet reference stored yet; judged either way
        if quiet(cal) and cal.get("quiet_readings"):  # a run's typical quiet reading, never one lucky one
            self.reference = self.search.offer_calibration(cal["typical_us"], self.reference)
        return final

    def _candidate(self, key: Key, impl: Impl, results: list[TrialResult], work: dict) -> Candidate | None:
        if not results:
            return None
        ok = [r for r in results if not r.failed]
        if not ok:
            errs = [r.info.get("rel_err") for r in results if isinstance(r.info.get("rel_err"), float)]
            tol = next((r.info["tolerance"] for r in results if r.info.get("tolerance")), None)
            passed = [r for r in results if isinstance(r.info.get("rel_err"), float) and tol
                      and r.info["rel_err"] <= tol]
            first = (passed or results)[0]  # numerics passed but no time: why (e.g. not measurable)
            ran = any("rel_err" in r.info for r in results)  # numerics ran (maybe nan: recorded as "nan")
            measured = {"rel_err": min(errs) if errs else ("nan" if ran else None), "tolerance": tol,
                        "trials": len(results), "error": first.info.get("error", "")}
            if isinstance(first.info.get("calibration"), dict):  # a time verdict keeps its numbers and conditions
                measured.update({k: first.info[k] for k in ("kernel_us", "compiler_us", "region") if k in first.info})
                measured["calibration"] = self._judged({"calibration": dict(first.info["calibration"])})["calibration"]
            return Candidate(impl.name, first.config, measured, numerics_ok=bool(passed))
        order = {str(sorted(c.items())): i for i, c in enumerate(impl.configs(key))}
        best = best_trial(ok, order, self.options.objective)
        final = self.search.final(key, impl, best.config, work, stop=self.over_budget)
        if final is None:
            return None
        if "reference_us" not in (final.get("calibration") or {}):  # stored by a run before references: judge it
            final = self._judged(dict(final))  # (one judged when stored is the same for every worker that reads it)
        if "error" in final and "speedup" not in final:
            return Candidate(impl.name, dict(best.config), {
                "rel_err": best.info.get("rel_err"), "tolerance": best.info.get("tolerance"),
                "trials": len(results), "error": f"final comparison: {final['error']}"}, numerics_ok=True)
        measured = {**final, "rel_err": best.info.get("rel_err"), "tolerance": best.info.get("tolerance"),
                    "trials": len(results), "failed": len(results) - len(ok)}
        return Candidate(impl.name, dict(best.config), measured, numerics_ok=True)
