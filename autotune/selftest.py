"""``nki-autotune selftest``: the one command that confirms the whole neuron path on a Trainium host (trn2, trn3),
and a report to paste into an issue.

1. environment: the neuron backend's availability, its fingerprint (platform target, logical cores, instance type,
   neuronx-cc, nki and torch-neuronx versions, NEURON_CC_FLAGS), the NKI import point (the real nki, or the
   interpreter and why) and the limits in force;
2. numerics: every NKI impl on its op's example inputs on the device, so each kernel is compiled by the real stack,
   forward and backward against the float64 reference;
3. compiled: every NKI impl inside ``torch.compile(backend="neuron", fullgraph=True)`` gives its eager result;
4. tuning: a two-key profile tuned against ``torch.compile(backend="neuron")``.

Where the neuron backend is unavailable, the report says why and the command exits 2.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..registry import Backend, Impl, Key, Profile, Site, TensorSpec, get_backend, ops
from ..registry.backend import dist_version
from ..registry.specs import short
from .check import check_all, example_key
from .inputs import make_inputs
from .measure import LocalBench
from .numerics import rel_err, tolerance
from .search import Search, open_storage
from .tuner import Options, Tuner

PASS, FAIL, SKIP = "pass", "FAIL", "skipped"
TUNING_SHAPES = ((64, 256), (512, 1024))
TUNING = {"trials": 4, "search_rounds": 5, "final_rounds": 10}
"""Configs tried per key, and timed rounds of a trial and of a final comparison: enough to tell a kernel from
the compiler."""
"""rmsnorm [rows, width] of the two tuned keys (training, float32)."""


@dataclass(frozen=True)
class Step:
    name: str
    status: str
    detail: str = ""


def environment(backend: Backend) -> list[tuple[str, str]]:
    from ..registry.neuron.limits import limits_target
    from ..registry.neuron.nki import REAL, TARGETED, WHY_NOT_REAL

    why = backend.why_unavailable()
    rows = [("neuron backend", "available" if why is None else f"unavailable: {why}")]
    try:
        rows += [(k, str(v)) for k, v in backend.fingerprint().items() if k != "backend"]
    except Exception as e:  # a broken configuration is part of the report
        rows.append(("fingerprint", f"{type(e).__name__}: {e}"))
    rows += [
        ("NKI", f"real nki, kernels written for {TARGETED}" if REAL else f"the project's interpreter: {WHY_NOT_REAL}"),
        ("limits of", limits_target().name),
        ("nki-autotune", dist_version("nki-autotune")),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
    ]
    return rows


def _impls(backend: Backend, names: tuple[str, ...] | None) -> list[Impl]:
    return [i for op in ops().values() if names is None or op.name in names
            for i in op.impls.values() if i.backend == backend.name]


def numerics(backend: Backend, names: tuple[str, ...] | None, seed: int) -> list[Step]:
    steps = []
    for row in check_all(names, seed=seed, backend=backend.name):
        shapes = " ".join(short(s) + (f":{s.dtype}" if s else "") for s in row.key.inputs)
        name = f"numerics {row.impl} {shapes} {row.key.mode}"
        if row.skipped:
            steps.append(Step(name, SKIP, row.skipped))
        elif row.passed:
            steps.append(Step(name, PASS, f"error {row.result.rel_err:.1e} within {row.result.tolerance:.0e}"))
        else:
            steps.append(Step(name, FAIL, row.error or (row.result.detail if row.result else "")))
    return steps


def _first_key(impl: Impl) -> Key | None:
    op = impl.op
    for inputs, extra in impl.all_examples:
        key = example_key(op, inputs, extra, "inference")
        if impl.supports(key.inputs, key.attr_dict) is None and impl.configs(key):
            return key
    return None


def compiled(backend: Backend, names: tuple[str, ...] | None, seed: int) -> list[Step]:
    """Each impl's custom op inside a compiled region of the backend gives what it gives eagerly."""
    steps = []
    for impl in _impls(backend, names):
        name = f"compiled {impl.qualname}"
        key = _first_key(impl)
        if key is None:
            steps.append(Step(name, SKIP, "no example input it supports"))
            continue
        try:
            op = impl.op
            inputs = make_inputs(op, key, torch.Generator().manual_seed(seed), device=backend.device)
            attrs, cfg = [key.attr_dict[a] for a in op.attrs], impl.call_args(None, key)

            def fn(*ts, impl=impl, attrs=attrs, cfg=cfg):
                out = impl.fwd_op(*ts, *attrs, *cfg)
                return out if isinstance(out, tuple) else (out,)

            with torch.no_grad():
                eager, comp = fn(*inputs), backend.compile(fn)(*inputs)
            err = max(rel_err(c, e.detach().cpu().double()) for c, e in zip(comp[:op.outputs], eager[:op.outputs]))
            ok = err == err and err <= tolerance(key)
            steps.append(Step(name, PASS if ok else FAIL, f"{key.label()}: compiled vs eager {err:.1e}"))
        except Exception as e:
            steps.append(Step(name, FAIL, f"{type(e).__name__}: {e}"))
    return steps


def tuning(backend: Backend, seed: int) -> Step:
    """A two-key rmsnorm profile tuned against the backend's compiler (studies in memory, nothing kept)."""
    sites = [Site("rmsnorm", (TensorSpec((n, d), "float32", requires_grad=True),
                              TensorSpec((d,), "float32", requires_grad=True)), {"eps": 1e-6}, site=f"selftest.{n}x{d}")
             for n, d in TUNING_SHAPES]
    options = Options(seed=seed, **TUNING)
    bench = LocalBench(backend, options.measure())  # in this process: a crash is itself what the selftest reports
    try:
        search = Search(open_storage("sqlite:///:memory:"), backend.fingerprint(), trials=options.trials, seed=seed)
        table = Tuner(backend, search, bench, options).tune(Profile(sites))
    except Exception as e:
        return Step("tuning", FAIL, f"{type(e).__name__}: {e}")
    finally:
        bench.close()
    decisions = "; ".join(f"{e.key.label()}: {e.impl or 'compiler'} ({e.reason})" for e in table.entries)
    timed = [e for e in table.entries if "kernel_us" in e.measured and "compiler_us" in e.measured]
    ok = len(timed) == len(TUNING_SHAPES)  # each key's kernel measured against the compiler, whichever won
    return Step("tuning", PASS if ok else FAIL, decisions)


def report(env: list[tuple[str, str]], steps: list[Step]) -> str:
    """Markdown, to paste into an issue."""
    lines = ["## nki-autotune selftest", "", "| item | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env]
    if steps:
        lines += ["", "| step | result | detail |", "|---|---|---|"]
        lines += [f"| {s.name} | {s.status} | {s.detail.replace('|', '/')} |" for s in steps]
    count = {st: sum(s.status == st for s in steps) for st in (PASS, FAIL, SKIP)}
    lines += ["", f"{count[PASS]} passed, {count[FAIL]} failed, {count[SKIP]} skipped"]
    return "\n".join(lines) + "\n"


def selftest(seed: int = 0, names: tuple[str, ...] | None = None, tune: bool = True,
             output: str | Path | None = None) -> tuple[int, str]:
    """(exit code, report): 0 every step passed, 1 a step failed, 2 the neuron backend is unavailable here."""
    backend = get_backend("neuron")
    env = environment(backend)
    steps: list[Step] = []
    if backend.available():
        steps += numerics(backend, names, seed)
        steps += compiled(backend, names, seed)
        if tune:
            steps.append(tuning(backend, seed))
    text = report(env, steps)
    if output is not None:
        Path(output).write_text(text)
    if not backend.available():
        return 2, text
    return (1 if any(s.status == FAIL for s in steps) else 0), text
