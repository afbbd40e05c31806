"""The decision rule (DESIGN §6.5) and the table entry that records it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..registry import Entry, Impl, Key


@dataclass(frozen=True)
class Candidate:
    """The final, side-by-side measurement of one impl's best config at one key."""

    impl: str
    config: dict[str, int]
    measured: dict[str, Any]
    """kernel_us, compiler_us, speedup, ci95, rounds, region, calibration, rel_err, tolerance, trials, compile_s;
    without ``speedup`` when no time could be measured (``not_measurable`` or ``error`` says why)."""
    numerics_ok: bool


def decide(key: Key, candidates: list[Candidate], threshold: float, sites: list[str], impls: dict[str, Impl],
           no_candidate_reason: str = "") -> Entry:
    """Enable the fastest numerically-correct impl whose median speedup is >= threshold, whose 95% interval lies
    above 1, and which was measured on a quiet machine; if none is, the compiler, with the fastest one's reason."""
    if not candidates:
        return Entry(key, None, sites=sites, reason=no_candidate_reason or "no impl was measured")

    def entry(c: Candidate, impl: str | None, measured: dict, reason: str) -> Entry:
        tuned = impls[c.impl]
        return Entry(key, impl, dict(c.config) if impl else {}, sites, tuned.source_hash, measured, reason,
                     tuned.module)

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
            return entry(c, None, m, f"not measurable at this size: {why}")
        return entry(c, None, m, f"{c.impl} could not be timed: {c.measured.get('error') or 'no time was measured'}")

    def passes(c: Candidate) -> bool:
        m = c.measured
        return (m.get("calibration") or {}).get("disturbed") is None and m["speedup"] >= threshold \
            and m["ci95"][0] > 1.0

    # the fastest impl that passes; if none does, the reason is the fastest one's
    best = max([c for c in timed if passes(c)] or timed, key=lambda c: c.measured["speedup"])
    m = best.measured
    lo, hi = m["ci95"]
    ci = f"95% CI {lo:.2f}-{hi:.2f}"
    err = f"error {_err(m['rel_err'])} within {m['tolerance']:.0e}"
    disturbed = (m.get("calibration") or {}).get("disturbed")
    if passes(best):
        return entry(best, best.impl, m, f"faster {m['speedup']:.2f}x ({ci}), {err}")
    if disturbed is not None:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x ({ci}) was measured on a disturbed machine ({disturbed})"
    elif m["speedup"] < threshold:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x ({ci}) is below the threshold {threshold:.2f}x"
    else:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x but its {ci} reaches 1"
    return entry(best, None, {**m, "impl": best.impl, "config": dict(best.config)}, why)


def _err(x: Any) -> str:
    return f"{x:.1e}" if isinstance(x, float) else "n/a" if x is None else str(x)
