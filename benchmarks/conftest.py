"""Benchmarks: each kernel against the compiler, measured the way the autotuner measures.

Each benchmark may record the bytes its op must move; the summary at the end prints the
achieved bandwidth of each next to this machine's copy bandwidth, measured in the same run.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

RESULTS: list[tuple[str, str, float, int]] = []  # (group, candidate, median seconds, bytes moved)


def record(benchmark, group: str, candidate: str, nbytes: int) -> None:
    if benchmark.stats is not None:
        RESULTS.append((group, candidate, benchmark.stats.stats.median, nbytes))


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    copy = [nbytes / t for g, _, t, nbytes in RESULTS if g == "copy"]
    tr = terminalreporter
    tr.section("achieved bandwidth (bytes that must move / median time)")
    if copy:
        tr.write_line(f"copy bandwidth of this machine, same run: {max(copy) / 1e9:.2f} GB/s")
    for group, cand, t, nbytes in RESULTS:
        if group == "copy" or not nbytes:
            continue
        share = f" ({nbytes / t / max(copy):.0%} of copy)" if copy else ""
        tr.write_line(f"{group:<52} {cand:<14} {t * 1e3:9.3f} ms {nbytes / t / 1e9:7.2f} GB/s{share}")
