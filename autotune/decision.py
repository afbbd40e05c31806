"""The decision rule (DESIGN §6.5) and the table entry that records it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..registry import Entry, Key


@dataclass(frozen=True)
class Candidate:
    """The final, side-by-side measurement of one impl's best config at one key."""

    impl: str
    config: dict[str, int]
    measured: dict[str, Any]
    """kernel_us, compiler_us, speedup, ci95, rounds, rel_err, tolerance, trials, compile_s, region."""
    numerics_ok: bool


def decide(key: Key, candidates: list[Candidate], threshold: float, sites: list[str], sources: dict[str, str],
           no_candidate_reason: str = "") -> Entry:
    """Enable the fastest numerically-correct impl if its median speedup >= threshold and its 95% interval
    lies above 1; otherwise the compiler, with the reason."""
    if not candidates:
        return Entry(key, None, sites=sites, reason=no_candidate_reason or "no impl was measured")
    correct = [c for c in candidates if c.numerics_ok]
    if not correct:
        worst = min(candidates, key=lambda c: c.measured.get("rel_err", float("inf")))
        return Entry(key, None, sites=sites, measured=worst.measured,
                     reason=f"no config of {', '.join(c.impl for c in candidates)} passed numerics "
                            f"(best error {_err(worst.measured.get('rel_err'))} above "
                            f"{worst.measured.get('tolerance') or 0:.0e})")
    best = max(correct, key=lambda c: c.measured["speedup"])
    m = best.measured
    lo, hi = m["ci95"]
    ci = f"95% CI {lo:.2f}-{hi:.2f}"
    err = f"error {_err(m['rel_err'])} within {m['tolerance']:.0e}"
    if m["speedup"] >= threshold and lo > 1.0:
        return Entry(key, best.impl, dict(best.config), sites, sources.get(best.impl), m,
                     f"faster {m['speedup']:.2f}x ({ci}), {err}")
    if m["speedup"] < threshold:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x ({ci}) is below the threshold {threshold:.2f}x"
    else:
        why = f"best kernel {best.impl} {m['speedup']:.2f}x but its {ci} reaches 1"
    return Entry(key, None, sites=sites, source=sources.get(best.impl),
                 measured={**m, "impl": best.impl, "config": dict(best.config)}, reason=why)


def _err(x: Any) -> str:
    return "n/a" if x is None else f"{x:.1e}"
