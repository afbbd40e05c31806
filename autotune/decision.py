"""The decision rule (DESIGN §6.5) and the table entry that records it.

Two objectives. ``time`` (the default): the fastest kernel whose median speedup is at least the threshold and
whose 95% interval lies above 1. ``memory``: a kernel whose peak memory over its region is at most ``MEMORY_RATIO``
of the compiler's and that is not slower, that is whose speedup interval does not lie below 1 (its upper bound is
at least 1: not measured slower, the rule ``verify`` applies to a whole table); of several, the leanest of those
within ``SPEED_MARGIN`` of the fastest (``leanest_fast``). The 10% is a bar, not a race: a config that saves more
of what is already saved at the cost of time is not the one a user tuning for memory wants, and between configs of
one speed, within noise, the leaner is. Either way the machine was quiet while it was measured, and the entry
records the objective that chose it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..registry import Entry, Impl, Key
from ..registry.table import OBJECTIVES
from .search import TrialResult

MEMORY_RATIO = 0.9
"""Under the memory objective a kernel's peak must be at most this share of the compiler's: 10% lower or more."""
SPEED_MARGIN = 0.05
"""Under the memory objective, speedups within this share of the fastest count as one speed (a trial's median of
15 rounds moves by a few percent between runs on these machines)."""


def leanest_fast(items: Sequence, speedup, ratio):
    """Of ``items`` (each clearing the memory bar), the leanest among those within ``SPEED_MARGIN`` of the fastest;
    ties to the faster, then to the first."""
    top = max(speedup(x) for x in items)
    near = [x for x in items if speedup(x) * (1 + SPEED_MARGIN) >= top]
    return min(near, key=lambda x: (ratio(x), -speedup(x), items.index(x)))


@dataclass(frozen=True)
class Candidate:
    """The final, side-by-side measurement of one impl's best config at one key."""

    impl: str
    config: dict[str, int]
    measured: dict[str, Any]
    """kernel_us, compiler_us, speedup, ci95, rounds, region, calibration, kernel_peak_mib, compiler_peak_mib,
    rel_err, tolerance, trials, compile_s; without ``speedup`` when no time could be measured (``not_measurable``
    or ``error`` says why)."""
    numerics_ok: bool


def peak_ratio(measured: dict[str, Any]) -> float | None:
    """The kernel's peak memory over its region as a share of the compiler's (None where either is missing)."""
    k, c = measured.get("kernel_peak_mib"), measured.get("compiler_peak_mib")
    if not isinstance(k, (int, float)) or not isinstance(c, (int, float)) or c <= 0:
        return None
    return k / c


def best_trial(results: Sequence[TrialResult], order: dict[str, int], objective: str = "time") -> TrialResult:
    """The config of one impl that gets the final comparison, from its trials that passed: the fastest (time); of
    those not slower in their trial and with a peak at most ``MEMORY_RATIO`` of the compiler's, the leanest of
    those near the fastest (``leanest_fast``), else of those not slower the one of lowest peak (memory); else the
    fastest. Ties go to the config listed first (``order``), so every worker picks the same one."""
    def first(r: TrialResult) -> int:
        return -order.get(str(sorted(r.config.items())), 0)

    if objective == "memory":
        small = [r for r in results if r.speedup >= 1.0 and peak_ratio(r.info) is not None]
        lean = sorted((r for r in small if peak_ratio(r.info) <= MEMORY_RATIO), key=first, reverse=True)
        if lean:
            return leanest_fast(lean, lambda r: r.speedup, lambda r: peak_ratio(r.info))
        if small:
            return max(small, key=lambda r: (-peak_ratio(r.info), r.speedup, first(r)))
    return max(results, key=lambda r: (r.speedup, first(r)))


def decide(key: Key, candidates: list[Candidate], threshold: float, sites: list[str], impls: dict[str, Impl],
           no_candidate_reason: str = "", objective: str = "time") -> Entry:
    """Enable the best numerically-correct impl that passes the ``objective``'s rule (the module's docstring) and
    was measured on a quiet machine; if none does, the compiler, with the best one's reason."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of: {', '.join(OBJECTIVES)}")
    if not candidates:
        return Entry(key, None, sites=sites, reason=no_candidate_reason or "no impl was measured")

    def entry(c: Candidate, impl: str | None, measured: dict, reason: str) -> Entry:
        tuned = impls[c.impl]
        return Entry(key, impl, dict(c.config) if impl else {}, sites, tuned.source_hash,
                     {**measured, "objective": objective}, reason, tuned.module)

    correct = [c for c in candidates if c.numerics_ok]
    if not correct:
        checked = [c for c in candidates if c.measured.get("rel_err") is not None]
        if not checked:  # no config got as far as its numerics: it crashed, hung or raised
            c = candidates[0]
            return entry(c, None, {**c.measured, "impl": c.impl},
                         f"no config of {', '.join(x.impl for x in candidates)} ran: {c.measured.get('error')}")
        worst = min(checked, key=lambda c: c.measured["rel_err"] if isinstance(c.measured["rel_err"], float)
                    else float("inf"))
        return entry(worst, None, {**worst.measured, "impl": worst.impl},
                     f"no config of {', '.join(c.impl for c in candidates)} passed numerics "
                     f"(best error {_err(worst.measured.get('rel_err'))} above "
                     f"{worst.measured.get('tolerance') or 0:.0e})")
    timed = [c for c in correct if "speedup" in c.measured]
    if not timed:
        c = correct[0]
        m = {**c.measured, "impl": c.impl, "config": dict(c.config)}
        if c.measured.get("not_measurable") or c.measured.get("error", "").startswith("not measurable"):
            why = c.measured.get("not_measurable") or c.measured["error"].removeprefix("not measurable: ")
            disturbed = (m.get("calibration") or {}).get("disturbed")
            on = f" (measured on a disturbed machine: {disturbed})" if disturbed else ""
            return entry(c, None, m, f"not measurable at this size: {why}{on}")
        return entry(c, None, m, f"{c.impl} could not be timed: {c.measured.get('error') or 'no time was measured'}")

    memory = objective == "memory"

    def passes(c: Candidate) -> bool:
        m = c.measured
        if (m.get("calibration") or {}).get("disturbed") is not None:
            return False
        if memory:
            return _memory_refusal(c) is None
        return m["speedup"] >= threshold and m["ci95"][0] > 1.0

    def lean(c: Candidate) -> tuple:
        ratio = peak_ratio(c.measured)
        return -(math.inf if ratio is None else ratio), c.measured["speedup"]

    # the impl that passes (the fastest; under memory, ``leanest_fast``); if none does, the reason is the best
    # one's (under memory, the leanest's)
    passing = [c for c in timed if passes(c)]
    if memory:
        best = leanest_fast(passing, lambda c: c.measured["speedup"], lambda c: peak_ratio(c.measured)) \
            if passing else max(timed, key=lean)
    else:
        best = max(passing or timed, key=lambda c: c.measured["speedup"])
    m = best.measured
    lo, hi = m["ci95"]
    ci = f"95% CI {lo:.2f}-{hi:.2f}"
    err = f"error {_err(m['rel_err'])} within {m['tolerance']:.0e}"
    disturbed = (m.get("calibration") or {}).get("disturbed")
    if passes(best):
        return entry(best, best.impl, m, f"objective memory: peak {_peaks(m)}, not slower {m['speedup']:.2f}x "
                     f"({ci}), {err}" if memory else f"faster {m['speedup']:.2f}x ({ci}), {err}")
    if disturbed is not None:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x ({ci}) was measured on a disturbed machine ({disturbed})"
        why = f"objective memory: {why}" if memory else why
    elif memory:
        why = f"objective memory: {_memory_refusal(best)}"
    elif m["speedup"] < threshold:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x ({ci}) is below the threshold {threshold:.2f}x"
    else:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x but its {ci} reaches 1"
    return entry(best, None, {**m, "impl": best.impl, "config": dict(best.config)}, why)


def _peaks(m: dict[str, Any]) -> str:
    return f"{peak_ratio(m):.2f}x the compiler's ({m['kernel_peak_mib']:g} of {m['compiler_peak_mib']:g} MiB)"


def _memory_refusal(c: Candidate) -> str | None:
    """Why the memory objective refuses ``c`` (a disturbed machine aside), or None where it passes."""
    m = c.measured
    ratio = peak_ratio(m)
    if ratio is None:
        return f"the peak memory of best kernel {c.impl} was not measured" + \
            (f": {m['peak_error']}" if m.get("peak_error") else "")
    if ratio > MEMORY_RATIO:
        return f"best kernel {c.impl}'s peak is {_peaks(m)}, above {MEMORY_RATIO:.2f}x"
    lo, hi = m["ci95"]
    if hi < 1.0:
        return f"best kernel {c.impl}'s peak is {_peaks(m)} but it is slower: {m['speedup']:.2f}x (95% CI " \
               f"{lo:.2f}-{hi:.2f} lies below 1)"
    return None


def _err(x: Any) -> str:
    return f"{x:.1e}" if isinstance(x, float) else "n/a" if x is None else str(x)
