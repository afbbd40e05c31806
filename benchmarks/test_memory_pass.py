"""What measuring peak memory adds to the tuner's time, per key of the example's profile.

For each key, in this process as a worker runs it: preparing the key (compiling the compiler's and the empty
regions), one trial of the kernel at its default config (compile, numerics, timed rounds, the kernel's memory pass
and, first of the key, the compiler's) and the final comparison (timed rounds, the kernel's memory pass). Printed:
each memory pass's time, and what the passes add to a key tuned with ``--trials 6`` (``make demo`` runs 4): the
compiler's pass once, the kernel's in each of 6 trials and in the final comparison, against the time of the key
without them. Run: ``pytest benchmarks/test_memory_pass.py -s`` (part of ``make bench``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import nki_autotune.kernels  # noqa: F401
from nki_autotune.autotune.measure import LocalBench, MeasureOptions, region_peak
from nki_autotune.registry import get_backend, get_op, load_profile, ops

PROFILE = Path(__file__).parents[1] / "examples" / "profile.yaml"
TRIALS = 6


def test_memory_pass_cost_per_key(capsys):
    backend = get_backend("cpu")
    passes: list[tuple[str, float]] = []
    peak = region_peak(backend)

    def timed_peak(runner) -> int:
        t0 = time.perf_counter()
        try:
            return peak(runner)
        finally:
            passes.append((runner.name, time.perf_counter() - t0))

    bench = LocalBench(backend, MeasureOptions(retries=0), lock=contextlib.nullcontext, peak=timed_peak)
    rows = []
    for key in load_profile(PROFILE, ops()).keys(ops()):
        impl = next(i for i in get_op(key.op).impls.values()
                    if i.backend == "cpu" and i.supports(key.inputs, key.attr_dict) is None)
        passes.clear()
        t0 = time.perf_counter()
        bench.prepare(key)
        t1 = time.perf_counter()
        result = bench.trial(key, impl.name, impl.default)
        t2 = time.perf_counter()
        final = bench.final(key, impl.name, impl.default)
        t3 = time.perf_counter()
        assert not result.failed and "kernel_peak_mib" in final, (result.info, final)
        compiler = sum(s for name, s in passes if name == "compiler")
        kernel = [s for name, s in passes if name != "compiler"]
        added = compiler + (TRIALS + 1) * sum(kernel) / len(kernel)
        trial = t2 - t1 - compiler - kernel[0]
        without = (t1 - t0) + TRIALS * trial + (t3 - t2 - kernel[1])
        rows.append((key.label()[:60], compiler, kernel, added, without, final))
    bench.close()
    with capsys.disabled():
        print(f"\nthe memory pass per key of {PROFILE.name} (seconds; a key tuned with --trials {TRIALS})")
        print(f"{'key':<60} {'compiler':>8} {'kernel':>13} {'added':>6} {'key without':>11} {'share':>6} "
              f"{'peak MiB kernel/compiler':>25}")
        for label, compiler, kernel, added, without, final in rows:
            peaks = f"{final['kernel_peak_mib']:g} / {final['compiler_peak_mib']:g}"
            print(f"{label:<60} {compiler:8.3f} {kernel[0]:6.3f} {kernel[1]:6.3f} {added:6.2f} {without:11.2f} "
                  f"{added / without:6.1%} {peaks:>25}")
        total = sum(r[3] for r in rows), sum(r[4] for r in rows)
        print(f"{'all keys':<60} {'':>8} {'':>13} {total[0]:6.2f} {total[1]:11.2f} {total[0] / total[1]:6.1%}")
