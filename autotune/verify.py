"""``nki-autotune verify TABLE STEP``: the full training step under the table, against every kernel off and
every kernel on, then each enabled entry switched off alone (docs/design.md §6.7).

The sum of isolated kernel measurements is not the full iteration: a kernel's custom-op call, the fusion it
prevents and the memory it touches show up only in the whole step. So the step itself is timed, in one
process, the variants interleaved in an order shuffled every round, and each entry's realized saving
(the step with that entry off, paired against the full table) is set beside its predicted one
(calls per step x (compiler - kernel)). After the timed rounds one more step of each variant, untimed, gives its
peak memory (``memory.peak_bytes``), and so each entry's realized memory saving.

STEP is ``path/to/file.py:function`` or ``package.module:function``: a function of no arguments that builds a
model, its optimizer and its data from fixed seeds and returns a zero-argument callable running one full
training step (forward, backward, optimizer step) and returning the loss. It is called once per variant, so
every variant starts from the same weights and batches; gradients are read at the optimizer's first step.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..registry import Entry, Table, scope
from ..registry.env import KERNELS, TABLE
from .memory import mib, peak_bytes
from .stats import median, paired_difference, ratio_of_medians


class StepError(ValueError):
    """STEP cannot be loaded or does not follow the protocol."""


def load_step(spec: str) -> Callable[[], Callable[[], Any]]:
    """The function named by ``path/to/file.py:function`` or ``package.module:function``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise StepError(f"STEP {spec!r} must be path/to/file.py:function or package.module:function")
    if target.endswith(".py") or "/" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise StepError(f"STEP {spec!r}: no such file {target}")
        sys.path.insert(0, str(path.parent))  # the script's own imports resolve as when it runs
        mod_spec = importlib.util.spec_from_file_location(f"_nki_autotune_step_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise StepError(f"STEP {spec!r}: cannot import {target}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = ", ".join(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise StepError(f"STEP {spec!r}: {target} has no function {name!r} (it has: {found or 'none'})")
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise StepError(f"STEP {spec!r}: {name}{inspect.signature(fn)} needs arguments; verify calls it with none "
                        "(make_step() -> step)") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return fn


@dataclass
class Variant:
    name: str
    env: dict[str, str]
    step: Callable[[], Any] | None = None
    times: list[float] = field(default_factory=list)
    entry: int | None = None
    """For an ablation: the index of the entry switched off."""
    peak: int | None = None
    """Bytes: the peak memory of one step above what was live before it."""
    same_as: str | None = None
    """The variant whose code this one runs, whose times and peak it takes instead of being timed again: the table
    without its only enabled entry runs what every kernel off runs."""


@contextmanager
def _first_gradients(out: dict) -> Any:
    """Record every parameter gradient at the first optimizer step inside the block."""
    def hook(optimizer, args, kwargs):
        if "grads" not in out:
            out["grads"] = [p.grad.detach().double().flatten().clone() for g in optimizer.param_groups
                            for p in g["params"] if p.grad is not None]

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield out
    finally:
        handle.remove()


def _loss(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@dataclass
class Report:
    table: str
    variants: dict[str, dict[str, Any]]
    speedups: dict[str, dict[str, Any]]
    numerics: dict[str, dict[str, Any]]
    entries: list[dict[str, Any]]
    verdict: str
    slower: bool
    numerics_ok: bool
    memory: dict[str, float | None] = field(default_factory=dict)
    """Ratios of the variants' peak memory per step, as ``speedups`` pairs them (table over off ...)."""
    ceiling: dict[str, Any] | None = None
    """What the table's call sites cost under the compiler (each measured apart) and the speedup of a step whose
    kernels took no time at all: about the most any table can give this step (``exceeded``: the step measured
    faster than that, so the sites cost more in the step than apart)."""

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("table", "variants", "speedups", "memory", "numerics", "entries",
                                              "verdict", "slower", "numerics_ok", "ceiling")}


def _calls(e: Entry) -> int:
    return e.measured.get("calls_per_step", len(e.sites) or 1)


def _us(e: Entry, field: str) -> float | None:
    v = e.measured.get(field)
    return v if isinstance(v, (int, float)) else None


def ceiling(table: Table, off_ms: float) -> dict[str, Any] | None:
    """Amdahl's bound from the compiler's time at every entry's call sites, as the tuner measured them apart
    (None if none was measured)."""
    covered = [_calls(e) * us / 1e3 for e in table.entries if (us := _us(e, "compiler_us")) is not None]
    if not covered:
        return None
    ms = sum(covered)
    return {"compiler_ms": round(ms, 3), "step_ms": round(off_ms, 3),
            "speedup": round(off_ms / (off_ms - ms), 4) if ms < off_ms else None}


def _pays_in_memory(peak_saving: int | None, saving: float, hi: float) -> bool:
    """Never more memory, then time: a lower step peak and not shown slower, or the same peak and a time saving."""
    if peak_saving is None or peak_saving < 0:
        return False
    return hi >= 0 if peak_saving > 0 else saving > 0


class Verifier:
    def __init__(self, table: Table, table_path: str, make_step: Callable[[], Callable[[], Any]], rounds: int = 20,
                 warmup: int = 3, seed: int = 0, tolerance: float = 1e-3, ablate: bool = True,
                 say: Callable[[str], None] = lambda s: None, peak: Callable[[Callable[[], Any]], int] = peak_bytes):
        self.table, self.path, self.make_step = table, table_path, make_step
        self.rounds, self.warmup, self.seed, self.tolerance, self.ablate = rounds, warmup, seed, tolerance, ablate
        self.say, self.peak = say, peak
        self._dir = tempfile.TemporaryDirectory(prefix="nki-autotune-verify-")

    def enabled(self) -> list[int]:
        return [i for i, e in enumerate(self.table.entries) if e.impl is not None]

    def _without(self, i: int) -> str:
        """A copy of the table with entry ``i`` sent back to the compiler."""
        entries = [Entry(e.key, None, {}, e.sites, e.source, e.measured, "switched off by verify", e.module)
                   if j == i else e for j, e in enumerate(self.table.entries)]
        path = Path(self._dir.name) / f"without-{i}.yaml"
        Table(self.table.fingerprint, entries, self.table.created).save(path)
        return str(path)

    def variants(self) -> list[Variant]:
        out = [Variant("table", {TABLE: self.path}), Variant("off", {KERNELS: "off"}),
               Variant("on", {TABLE: self.path, KERNELS: "on"})]  # on: the table's impls and configs where it names one
        if self.ablate:
            enabled = self.enabled()
            same = "off" if len(enabled) == 1 else None  # without its only kernel the table is every kernel off
            out += [Variant(f"without entries[{i}]", {TABLE: self._without(i)}, entry=i, same_as=same) for i in enabled]
        return out

    def run(self) -> Report:
        cfg = torch._dynamo.config  # every variant keeps its graphs: 3 instances, one more per ablation
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 1024)
        variants = self.variants()
        numerics: dict[str, dict[str, Any]] = {}
        first: dict[str, dict] = {}
        for v in variants[:3]:  # each main variant on its own instance, from the same seeds
            torch.manual_seed(self.seed)
            random.seed(self.seed)
            with scope(**v.env), _first_gradients(first.setdefault(v.name, {})) as seen:
                v.step = self.make_step()
                if not callable(v.step):
                    raise StepError(f"STEP returned {type(v.step).__name__}, not the callable running one training "
                                    "step (make_step() -> step, step() -> loss)")
                seen["loss"] = _loss(v.step())
        for v in variants[1:]:  # then every variant is timed on the table's instance, its own graphs compiled
            v.step = variants[0].step  # for its switches: two instances of one model differ by a few percent
        ref = first["off"]
        if ref.get("loss") is None and "grads" not in ref:
            raise StepError("STEP's step returned no loss (a one-element tensor or a number) and took no optimizer "
                            "step, so the variants' numerics cannot be compared: make step() return the loss")
        for name in ("table", "on"):
            got = first[name]
            row: dict[str, Any] = {}
            if got.get("loss") is not None and ref.get("loss") is not None:
                row["loss_rel_diff"] = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
            if "grads" in got and "grads" in ref and len(got["grads"]) == len(ref["grads"]):
                row["grad_rel_diff"] = _rel(torch.cat(got["grads"]), torch.cat(ref["grads"]))
            row["ok"] = bool(row) and all(x <= self.tolerance for x in row.values())
            numerics[name] = row
        timed = [v for v in variants if v.same_as is None]
        self.say(f"warm-up: {len(timed)} variants x {self.warmup} steps")
        for v in timed:
            with scope(**v.env):
                for _ in range(self.warmup):
                    v.step()
        rng = random.Random(self.seed)
        order = list(timed)
        for r in range(self.rounds):
            rng.shuffle(order)
            for v in order:
                with scope(**v.env):
                    t0 = time.perf_counter()
                    v.step()
                    v.times.append(time.perf_counter() - t0)
            self.say(f"round {r + 1}/{self.rounds}")
        self.say(f"peak memory: one more step of each of the {len(timed)} variants")
        for v in timed:
            with scope(**v.env):
                v.peak = self.peak(v.step)
        by = {v.name: v for v in variants}
        for v in variants:
            if v.same_as is not None:
                v.times, v.peak = by[v.same_as].times, by[v.same_as].peak
        return self._report(variants, numerics)

    def _report(self, variants: list[Variant], numerics: dict) -> Report:
        by = {v.name: v for v in variants}
        out = {v.name: {"ms_per_step": round(median(v.times) * 1e3, 3), "rounds": len(v.times),
                        "times_ms": [round(t * 1e3, 3) for t in v.times],
                        "peak_mib": None if v.peak is None else mib(v.peak)} for v in variants[:3]}
        speedups, memory = {}, {}
        for name, base in (("table", "off"), ("on", "off"), ("table", "on")):
            s, (lo, hi) = ratio_of_medians(by[base].times, by[name].times, seed=self.seed)
            speedups[f"{name} over {base}"] = {"speedup": round(s, 4), "ci95": [round(lo, 4), round(hi, 4)]}
            a, b = by[name].peak, by[base].peak
            memory[f"{name} over {base}"] = round(a / b, 4) if a is not None and b else None
        entries = []
        for v in variants[3:]:
            e = self.table.entries[v.entry]
            saving, (lo, hi) = paired_difference(v.times, by["table"].times, seed=self.seed)
            c, k = _us(e, "compiler_us"), _us(e, "kernel_us")
            predicted = None if c is None or k is None else _calls(e) * (c - k) / 1e3
            peak_saving = None if v.peak is None or by["table"].peak is None else v.peak - by["table"].peak
            # an entry chosen for its memory pays where it lowers the step's peak and is not shown slower, or where it
            # leaves the peak as it is and saves time (the decision's two branches, docs/design.md §6.5)
            by_memory = e.measured.get("objective") == "memory"
            entries.append({
                "entry": v.entry, "key": e.key.label(), "impl": e.impl,
                "predicted_ms": None if predicted is None else round(predicted, 3),
                "realized_ms": round(saving * 1e3, 3), "realized_ci95": [round(lo * 1e3, 3), round(hi * 1e3, 3)],
                "times_ms": [round(t * 1e3, 3) for t in v.times], "timed_as": v.same_as,
                "realized_peak_mib": None if peak_saving is None else mib(peak_saving),
                "objective": "memory" if by_memory else "time",
                "kept": _pays_in_memory(peak_saving, saving, hi) if by_memory else saving > 0,
            })
        t = speedups["table over off"]
        some = bool(self.enabled())
        slower = t["ci95"][1] < 1.0 and some
        if not some:  # the same code as every kernel off: what it measures is the step's own spread
            verdict = f"the table enables no kernel: every call site runs the compiler's code, as with every kernel " \
                      f"off ({t['speedup']:.3f}x, 95% CI {t['ci95'][0]:.3f}-{t['ci95'][1]:.3f}, the same code timed " \
                      "twice)"
        elif slower:
            verdict = f"the table is slower than every kernel off: {t['speedup']:.3f}x (95% CI {t['ci95'][0]:.3f}-" \
                      f"{t['ci95'][1]:.3f})"
        elif t["ci95"][0] > 1.0:
            verdict = f"the table is faster than every kernel off: {t['speedup']:.3f}x (95% CI {t['ci95'][0]:.3f}-" \
                      f"{t['ci95'][1]:.3f})"
        else:
            verdict = f"the table is not shown faster or slower than every kernel off: {t['speedup']:.3f}x " \
                      f"(95% CI {t['ci95'][0]:.3f}-{t['ci95'][1]:.3f})"
        numerics_ok = all(r.get("ok", False) for r in numerics.values())
        bound = ceiling(self.table, out["off"]["ms_per_step"])
        if bound is not None:
            bound["exceeded"] = bound["speedup"] is None or t["ci95"][0] > bound["speedup"]
        return Report(self.path, out, speedups, numerics, entries, verdict, slower, numerics_ok, memory, bound)

    def pruned(self, report: Report) -> Table:
        """The table with every entry that does not pay sent back to the compiler: its realized saving is not positive
        or, for an entry chosen for memory, it neither lowers the step's peak without being shown slower nor leaves
        the peak as it is and saves time."""
        drop = {r["entry"]: r for r in report.entries if not r["kept"]}
        entries = []
        for i, e in enumerate(self.table.entries):
            if i not in drop:
                entries.append(e)
                continue
            r = drop[i]
            lo, hi = r["realized_ci95"]
            peak = "" if r["realized_peak_mib"] is None else f", realized peak saving {r['realized_peak_mib']:+g} MiB"
            reason = (f"verify: does not pay in the full step (realized saving {r['realized_ms']:+.3f} ms/step, "
                      f"95% CI {lo:+.3f} to {hi:+.3f}, predicted {r['predicted_ms']} ms{peak}); was: {e.reason}")
            entries.append(Entry(e.key, None, {}, e.sites, e.source, {**e.measured, "impl": e.impl,
                                 "config": dict(e.config)}, reason, e.module))
        return Table(self.table.fingerprint, entries)
