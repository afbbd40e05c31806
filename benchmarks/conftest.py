"""Benchmarks: each kernel against the compiler, measured the way the autotuner measures.

Each pack benchmark records, per op, shape and mode, the compiler's and the kernel's medians from one
interleaved run, the bytes the op must move and (training) the peak memory of each; the summary at the end
prints the achieved bandwidth of each kernel next to this machine's copy bandwidth, measured in the same run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))


@dataclass
class Result:
    """One op, shape and mode: medians (seconds) of one interleaved run, bytes moved, peak bytes (training)."""

    label: str
    mode: str
    compiler_s: float
    kernel_s: float
    speedup: float
    ci95: tuple[float, float]
    nbytes: int
    peak_compiler: int | None = None
    peak_kernel: int | None = None


RESULTS: list[Result] = []
COPY: list[float] = []
"""Copy bandwidths (bytes/s) measured in this run."""


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    copy = max(COPY) if COPY else None
    tr.section("kernel vs compiler, one interleaved run each (medians); bandwidth = bytes the op must move / time")
    if copy:
        tr.write_line(f"copy bandwidth of this machine, same run: {copy / 1e9:.1f} GB/s")
    tr.write_line(f"{'op, shape':<58} {'mode':<9} {'compiler':>10} {'kernel':>10} {'speedup':>8} {'95% CI':>11} "
                  f"{'kernel GB/s':>11} {'of copy':>7} {'peak MiB compiler/kernel':>25}")
    for r in RESULTS:
        bw = r.nbytes / r.kernel_s
        share = f"{bw / copy:.0%}" if copy else ""
        peak = f"{_mib(r.peak_compiler)} / {_mib(r.peak_kernel)}" if r.peak_kernel is not None else ""
        tr.write_line(f"{r.label:<58} {r.mode:<9} {r.compiler_s * 1e3:8.3f}ms {r.kernel_s * 1e3:8.3f}ms "
                      f"{r.speedup:7.2f}x {r.ci95[0]:5.2f}-{r.ci95[1]:<5.2f} {bw / 1e9:11.2f} {share:>7} {peak:>25}")
