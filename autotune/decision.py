"""The decision rule (docs/design.md §6.5) and the table entry that records it.

Two objectives. ``time`` (the default): the fastest kernel whose median speedup is at least the threshold and
whose 95% interval lies above 1. ``memory`` is "never more memory, then the time rule": a kernel is enabled where
its peak memory over its region is at most ``MEMORY_RATIO`` of the compiler's and it is not slower (its interval's
upper bound is at least 1: not measured slower, the rule ``verify`` applies to a whole table), and also where its
peak is not above the compiler's (``EQUAL_PEAK``) and it passes the time rule. A user who asks for less memory does
not ask for a slower step. Of several kernels a tenth leaner, the leanest of those within ``SPEED_MARGIN`` of the
fastest (``leanest_fast``): the 10% is a bar, not a race; of several at the compiler's memory, the fastest. Either
way the machine was quiet while it was measured, and the entry records the objective (and its reason, the branch)
that chose it.
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
EQUAL_PEAK = 1.001
"""A peak up to this share of the compiler's is the compiler's memory: both are recorded to four significant digits
(``memory.mib``), so equal peaks can read up to 0.1% apart."""
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
    those near the fastest (``leanest_fast``), else the fastest of those not slower at the compiler's peak, else of
    those not slower the one of lowest peak (memory: its final comparison says why it is refused); else the fastest.
    Ties go to the config listed first (``order``), so every worker picks the same one."""
    def first(r: TrialResult) -> int:
        return -order.get(str(sorted(r.config.items())), 0)

    if objective == "memory":
        peaked = [r for r in results if peak_ratio(r.info) is not None]
        lean = sorted((r for r in peaked if r.speedup >= 1.0 and peak_ratio(r.info) <= MEMORY_RATIO), key=first,
                      reverse=True)
        if lean:
            return leanest_fast(lean, lambda r: r.speedup, lambda r: peak_ratio(r.info))
        equal = [r for r in peaked if r.speedup >= 1.0 and peak_ratio(r.info) <= EQUAL_PEAK]
        if equal:
            return max(equal, key=lambda r: (r.speedup, first(r)))
        small = [r for r in peaked if r.speedup >= 1.0]
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

    def branch(c: Candidate) -> str | None:
        """Which rule enables ``c``: under memory ``lower`` or ``equal`` (``_memory_rule``), else ``time``."""
        if (c.measured.get("calibration") or {}).get("disturbed") is not None:
            return None
        if memory:
            return _memory_rule(c, threshold)[0]
        return "time" if _time_refusal(c, threshold) is None else None

    def speed(c: Candidate) -> float:
        return c.measured["speedup"]

    def lean(c: Candidate) -> tuple:
        ratio = peak_ratio(c.measured)
        return -(math.inf if ratio is None else ratio), c.measured["speedup"]

    # the impl that passes (the fastest; under memory the leaner's ``leanest_fast``, else the fastest at the
    # compiler's peak); if none does, the reason is the best one's (under memory, the leanest's)
    passing = {c.impl: branch(c) for c in timed if branch(c) is not None}
    lower = [c for c in timed if passing.get(c.impl) == "lower"]
    if lower:
        best = leanest_fast(lower, speed, lambda c: peak_ratio(c.measured))
    elif passing:
        best = max((c for c in timed if c.impl in passing), key=speed)
    else:
        best = max(timed, key=lean if memory else speed)
    m = best.measured
    lo, hi = m["ci95"]
    ci = f"95% CI {lo:.2f}-{hi:.2f}"
    err = f"error {_err(m['rel_err'])} within {m['tolerance']:.0e}"
    disturbed = (m.get("calibration") or {}).get("disturbed")
    how = passing.get(best.impl)
    if how == "lower":
        return entry(best, best.impl, m, f"objective memory: peak {_peaks(m)}, not slower {m['speedup']:.2f}x "
                     f"({ci}), {err}")
    if how == "equal":
        return entry(best, best.impl, m, f"objective memory: peak {_peaks(m)}, not above it, and faster "
                     f"{m['speedup']:.2f}x ({ci}), {err}")
    if how == "time":
        return entry(best, best.impl, m, f"faster {m['speedup']:.2f}x ({ci}), {err}")
    if disturbed is not None:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x ({ci}) was measured on a disturbed machine ({disturbed})"
        why = f"objective memory: {why}" if memory else why
    elif memory:
        why = f"objective memory: {_memory_rule(best, threshold)[1]}"
    else:
        why = _time_refusal(best, threshold)
    return entry(best, None, {**m, "impl": best.impl, "config": dict(best.config)}, why)


def _peaks(m: dict[str, Any]) -> str:
    return f"{peak_ratio(m):.2f}x the compiler's ({m['kernel_peak_mib']:g} of {m['compiler_peak_mib']:g} MiB)"


def _time_refusal(c: Candidate, threshold: float) -> str | None:
    """Why the time rule refuses ``c`` (a disturbed machine aside), or None where it passes."""
    m = c.measured
    lo, hi = m["ci95"]
    ci = f"95% CI {lo:.2f}-{hi:.2f}"
    if m["speedup"] < threshold:
        return f"best kernel {c.impl} {m['speedup']:.2f}x ({ci}) is below the threshold {threshold:.2f}x"
    if lo <= 1.0:
        return f"best kernel {c.impl} {m['speedup']:.2f}x but its {ci} reaches 1"
    return None


def _memory_rule(c: Candidate, threshold: float) -> tuple[str | None, str]:
    """Which branch of the memory objective enables ``c`` (a disturbed machine aside): ``lower`` (a tenth leaner
    and not slower) or ``equal`` (not above the compiler's peak and passing the time rule); else None and why."""
    m = c.measured
    ratio = peak_ratio(m)
    if ratio is None:
        return None, f"the peak memory of best kernel {c.impl} was not measured" + \
            (f": {m['peak_error']}" if m.get("peak_error") else "")
    lo, hi = m["ci95"]
    if ratio <= MEMORY_RATIO:
        if hi >= 1.0:
            return "lower", ""
        return None, f"best kernel {c.impl}'s peak is {_peaks(m)} but it is slower: {m['speedup']:.2f}x (95% CI " \
                     f"{lo:.2f}-{hi:.2f} lies below 1)"
    if ratio > EQUAL_PEAK:
        return None, f"best kernel {c.impl}'s peak is {_peaks(m)}, above the compiler's"
    slow = _time_refusal(c, threshold)
    if slow is None:
        return "equal", ""
    return None, f"best kernel {c.impl}'s peak is {_peaks(m)}, above {MEMORY_RATIO:.2f}x, and at about the " \
                 f"compiler's memory it must be faster: {slow.removeprefix(f'best kernel {c.impl} ')}"


def _err(x: Any) -> str:
    return f"{x:.1e}" if isinstance(x, float) else "n/a" if x is None else str(x)
