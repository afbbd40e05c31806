"""The work size at which a second thread pays, per CPU kernel: each impl's default config at one thread and at
every thread, on a ladder of sizes, forward and forward+backward, interleaved round by round (medians). The
smallest size from which every thread is faster in both modes, at it and at every larger size of the ladder, is
the kernel's ``SERIAL_BELOW`` (recorded beside it, in ``kernels/<op>/cpu.py``): below it the default config that
``NKI_AUTOTUNE_KERNELS=on`` runs uses one thread (``registry.cpu.threads.fit_threads``).

Run: ``.venv/bin/python -m pytest benchmarks/test_threads.py -s -p no:randomly``.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

import nki_autotune.kernels  # noqa: F401
from nki_autotune.autotune.inputs import make_inputs
from nki_autotune.autotune.stats import median
from nki_autotune.registry import Key, TensorSpec, get_op
from nki_autotune.registry.cpu.threads import max_threads

ROUNDS, BUDGET_S = 15, 0.002
"""Interleaved rounds; each sample repeats its call until it has run this long."""
ROWS = (2, 8, 32, 128, 512, 2048, 8192)
"""Rows of the ladder: each size below is rows x 256 elements (for the input the kernel's work is counted in)."""

LADDER = {  # op -> the key's inputs (shape, dtype) and attrs for ``rows``; the first input counts the work
    "rmsnorm": lambda r: ([((r, 256), "float32"), ((256,), "float32")], {}),
    "softmax": lambda r: ([((r, 256), "float32")], {}),
    "swiglu": lambda r: ([((r, 256), "float32"), ((r, 256), "float32")], {}),
    "rope": lambda r: ([((1, 4, r, 64), "float32"), ((1, 4, r, 64), "float32"), ((1, r, 64), "float32"),
                        ((1, r, 64), "float32")], {}),
    "cross_entropy": lambda r: ([((r, 256), "float32"), ((r,), "int64")], {}),
    "embedding": lambda r: ([((r * 4,), "int64"), ((512, 64), "float32")], {}),
    "segment_sum": lambda r: ([((r, 256), "float32"), ((r,), "int64")], {"num_segments": 32}),
    "geglu": lambda r: ([((r, 256), "float32"), ((r, 256), "float32")], {}),
    "attention": lambda r: ([((1, 4, r, 64), "float32"), ((1, 2, r, 64), "float32"), ((1, 2, r, 64), "float32"),
                             None], {"causal": True}),
    "linear_cross_entropy": lambda r: ([((r, 64), "float32"), ((256, 64), "float32"), ((r,), "int64"), None], {}),
}


def _key(op, rows: int) -> Key:
    inputs, attrs = LADDER[op.name](rows)
    specs = tuple(None if i is None else TensorSpec(tuple(i[0]), i[1]) for i in inputs)  # None: an absent optional
    return Key.of(op, specs, {**op.defaults, **attrs}, "training")


def _call(impl, key: Key, threads: int, backward: bool):
    """One call of the impl's op at its default config with ``threads``, or None where its constraint refuses."""
    cfg = {**impl.default, "threads": threads}
    if not impl.allows(cfg, key):
        cfg = next((c for c in impl.configs(key) if c["threads"] == threads), None)
        if cfg is None:
            return None
    ts = make_inputs(impl.op, key, torch.Generator().manual_seed(0))
    attrs = tuple(key.attr_dict[a] for a in impl.op.attrs)
    args = impl.call_args(cfg, key)
    leaves = [t for t in ts if t is not None and t.requires_grad]

    def fwd():
        out = impl.fwd_op(*ts, *attrs, *args)
        return out[0] if isinstance(out, (tuple, list)) else out

    if not backward:
        def forward_only():
            with torch.no_grad():
                return fwd()

        return forward_only
    g = torch.randn(fwd().shape)
    return lambda: torch.autograd.grad(fwd(), leaves, g)


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@pytest.mark.parametrize("op_name", list(LADDER))
def test_work_at_which_a_second_thread_pays(op_name, benchmark):
    op = get_op(op_name)
    impl = op.impls.get("cpu_" + {"rmsnorm": "rows"}.get(op_name, "")) or next(
        i for i in op.impls.values() if i.backend == "cpu")
    many = max_threads()
    lines, pays = [], []
    for rows in ROWS:
        key = _key(op, rows)
        work = math.prod(key.inputs[0].shape)
        variants = {(t, b): _call(impl, key, t, b) for t in (1, many) for b in (False, True)}
        if any(v is None for v in variants.values()):
            lines.append(f"{work:>9} elements: no config at {many} threads")
            pays.append(False)
            continue
        reps = {}
        for k, fn in variants.items():  # compile, warm up, and the calls per sample
            fn()
            reps[k] = max(1, int(BUDGET_S / max(_time(fn, 3), 1e-7)))
        samples = {k: [] for k in variants}
        order, rng = list(variants), random.Random(0)
        for _ in range(ROUNDS):
            rng.shuffle(order)
            for k in order:
                samples[k].append(_time(variants[k], reps[k]))
        us = {k: median(v) * 1e6 for k, v in samples.items()}
        ok = all(us[(many, b)] < us[(1, b)] for b in (False, True))
        pays.append(ok)
        lines.append(f"{work:>9} elements: forward {us[(1, False)]:8.1f} / {us[(many, False)]:8.1f} us, "
                     f"forward+backward {us[(1, True)]:8.1f} / {us[(many, True)]:8.1f} us (1 / {many} threads)"
                     + ("  second thread pays" if ok else ""))
    first = next((i for i in range(len(ROWS)) if all(pays[i:])), None)
    serial_below = None if first is None else math.prod(_key(op, ROWS[first]).inputs[0].shape)
    benchmark.extra_info.update(serial_below=serial_below, ladder=lines)
    benchmark.pedantic(lambda: None, rounds=1)
    print(f"\n{impl.qualname}: SERIAL_BELOW = {serial_below} (one thread / {many} threads, medians of {ROUNDS} "
          "interleaved rounds)")
    for line in lines:
        print("  " + line)
