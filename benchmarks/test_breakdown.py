"""Where a training call's time goes, kernel against compiler, at the element-wise shapes of the pack's benchmark.

Four regions, one call each (as in test_pack), timed interleaved in an order shuffled every round: the compiler's
code, the kernel, the kernel with its numba launches skipped (its outputs are left unwritten), and the empty
region of the same arity. Inside the kernel's region each numba launch is timed too. So, per call:

- compiler work = compiler region - empty region (Inductor's code for the op, forward and backward);
- kernel work = kernel region - empty region, of which the numba kernels themselves take the launches' time;
- glue = no-op kernel region - empty region: the custom operators, allocations and array views around them;
- of which views = no-op kernel region - the same with each numpy view made once per distinct tensor layout and
  then reused (``array``, ``as_rows``, RoPE's ``_heads``): the cost of making a kernel's arrays from its tensors.

Run: ``pytest benchmarks/test_breakdown.py -s`` (part of ``make bench``).
"""

from __future__ import annotations

import importlib
import random
import time

import pytest

import nki_autotune.kernels  # noqa: F401
from nki_autotune.autotune.stats import median
from nki_autotune.autotune.timing import Workload
from nki_autotune.registry import get_backend, get_op

from .test_pack import _hf, _key

CPU = get_backend("cpu")
F32 = "float32"

CASES = [  # op, inputs, attrs, rounds
    ("rmsnorm", [((2048, 512), F32), ((512,), F32)], [("eps", 1e-6)], 40),
    ("softmax", [((8, 4, 256, 256), F32)], [("dim", -1)], 20),
    ("swiglu", [((4, 256, 512), F32)] * 2, [], 40),
    ("swiglu", [((2048, 2048), F32)] * 2, [], 15),
    ("rope", [_hf(4, 4, 256, 64), _hf(4, 2, 256, 64), ((1, 256, 64), F32), ((1, 256, 64), F32)], [], 40),
    ("rope", [((8, 8, 512, 64), F32)] * 2 + [((8, 512, 64), F32)] * 2, [], 15),
]
_header_printed = False


def _label(case) -> str:
    op, inputs = case[0], case[1]
    return f"{op} " + "/".join("x".join(map(str, i[0])) + (" (HF)" if len(i) > 2 and i[2] else "") for i in inputs)


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_breakdown(case, monkeypatch, capsys):
    name, inputs, attrs, rounds = case
    op = get_op(name)
    impl = next(i for i in op.impls.values() if i.backend == "cpu")
    module = importlib.import_module(impl.forward.__module__)
    real, launches, skip = module.launch, [0.0], [False]

    def launch(kern, threads, *args):
        if skip[0]:
            return
        t0 = time.perf_counter()
        real(kern, threads, *args)
        launches[-1] += time.perf_counter() - t0

    monkeypatch.setattr(module, "launch", launch)
    reuse, made = [False], {}

    def viewing(helper):
        def view(t):
            if not reuse[0]:
                return helper(t)
            k = (helper, t.shape, t.stride(), t.dtype)
            if k not in made:
                made[k] = helper(t)
            return made[k]
        return view

    for helper in ("array", "as_rows", "_heads"):
        if hasattr(module, helper):
            monkeypatch.setattr(module, helper, viewing(getattr(module, helper)))
    w = Workload(op, _key(name, "training", inputs, attrs), CPU, sets=2)
    w.prepare(1)
    runners = {"compiler": w.compiler(), "kernel": w.kernel(impl, impl.default), "empty": w.empty()}
    runners["no-op kernel"] = runners["no-op, views reused"] = runners["kernel"]
    times: dict[str, list[float]] = {k: [] for k in runners}
    per_call: list[float] = []
    order, rng = list(runners), random.Random(0)
    for rnd in range(2 + rounds):
        rng.shuffle(order)
        for k in order:
            skip[0] = k.startswith("no-op")
            reuse[0] = k == "no-op, views reused"
            launches.append(0.0)
            t0 = time.perf_counter()
            runners[k].step(rnd)
            t = time.perf_counter() - t0
            if rnd >= 2:
                times[k].append(t)
                if k == "kernel":
                    per_call.append(launches[-1])
    m = {k: median(v) * 1e6 for k, v in times.items()}
    row = (f"{_label(case):<62} {m['compiler']:9.1f} {m['kernel']:9.1f} {m['no-op kernel']:9.1f} "
           f"{m['empty']:8.1f} | {m['compiler'] - m['empty']:9.1f} {m['kernel'] - m['empty']:9.1f} "
           f"{median(per_call) * 1e6:9.1f} {m['no-op kernel'] - m['empty']:7.1f} "
           f"{m['no-op kernel'] - m['no-op, views reused']:7.1f}")
    global _header_printed
    with capsys.disabled():
        if not _header_printed:
            _header_printed = True
            print(f"\nwhere a training call's time goes (us, medians of interleaved rounds; one call per region, "
                  f"default configs)\n{'op, shape':<62} {'compiler':>9} {'kernel':>9} {'no-op k.':>9} {'empty':>8} | "
                  f"{'compiler':>9} {'kernel':>9} {'numba':>9} {'glue':>7} {'of which':>8}\n{'':<62} {'region':>9} "
                  f"{'region':>9} {'region':>9} {'region':>8} | {'work':>9} {'work':>9} {'kernels':>9} {'':>7} "
                  f"{'views':>8}")
        print(row)
    assert len(per_call) == rounds and all(t > 0 for t in per_call)  # the kernel's launches ran in its region

