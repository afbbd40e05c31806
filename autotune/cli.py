"""The ``nki-autotune`` command: run, show, diff, list, record, check, verify.

Exit codes: 0 success, 1 the work failed, 2 bad usage or bad input.

``show`` and ``diff`` read tables as plain data and never import torch or the kernels; the other commands
import them when they start (``_heavy``), after their own checks of the environment.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from ..registry import FormatError, SettingsError, load_profile, load_table, switch_variables
from ..registry.backend import dist_version
from ..registry.env import KERNEL_OP, KERNELS, LOG, RECORD, RECORD_SAMPLES, STRICT, TABLE, read_settings
from ..registry.profile import merge
from ..registry.specs import short
from ..registry.table import OBJECTIVES
from ..registry.yamlio import atomic_write_text, unwritable
from ..registry.yamlio import load as load_yaml
from . import report
from .stats import MIN_ROUNDS


class UsageError(Exception):
    """Bad usage or bad input: exit code 2."""


class Interrupted(KeyboardInterrupt):
    """Stopped by a signal (Ctrl-C's SIGINT, or SIGTERM from a scheduler): exit code 128 + its number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def _writable(path: str, option: str) -> None:
    """Refuse an output path that cannot be a file before any work is done."""
    why = unwritable(path)
    if why is not None:
        raise UsageError(f"{option} {path} {why}")


def _heavy(imports: list[str] | None = None):
    """The registry's torch side with the kernel pack registered, then the user's modules (``--import``)."""
    import nki_autotune.kernels  # noqa: F401  (registers every op of the pack)

    from .. import registry

    for name in imports or ():
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UsageError(f"--import {name}: cannot import it: {e}") from None
    registry.check_switches()
    return registry


# -- run --------------------------------------------------------------------------------------------------------


class _Bar:
    def __init__(self, progress: Progress, trials: int, console: Console):
        self.p, self.trials, self.console = progress, trials, console
        self.best: float | None = None

    def keys(self, n):
        self.sites = self.p.add_task("sites", total=n)
        self.trial = self.p.add_task("trials", total=None)

    def key_started(self, key, sites):
        self.best = None
        self.p.update(self.trial, completed=0, total=self.trials,
                      description=f"{key.op} {' '.join(short(s) for s in key.inputs)} {key.mode}")

    def trial_done(self, key, impl, result):
        if not result.failed:
            self.best = max(self.best or 0.0, result.speedup)
        self.p.advance(self.trial)
        best_s = f"best {self.best:.2f}x" if self.best else "no passing config yet"
        self.p.update(self.sites, description=f"sites  ({best_s})")

    def key_done(self, key, entry):
        self.p.advance(self.sites)

    def note(self, message):
        self.console.print(f"[yellow]note[/]: {message}")


def _not_recording(what: str) -> None:
    recording = read_settings(os.environ).record
    if recording:
        raise UsageError(f"{RECORD} is set ({recording}): it records this process and runs compiled regions "
                         f"eagerly, so nothing would be measured compiled; unset it to {what}")


def cmd_run(args, console: Console) -> int:
    _not_recording("tune")
    registry = _heavy(args.imports)
    from .search import Search, default_storage, open_storage
    from .tuner import Options, Tuner
    from .worker import IsolatedBench, default_memory_limit

    registered = registry.ops()
    if args.backend == "auto":
        backend = registry.default_backend()
    else:
        backend = registry.get_backend(args.backend)
        why = backend.why_unavailable()
        if why is not None:
            raise UsageError(f"backend {args.backend} is not available here: {why}")
    _writable(args.output, "-o")
    profile = load_profile(args.profile, registered)
    wanted = None
    if args.ops:
        wanted = tuple(o.strip() for o in args.ops.split(",") if o.strip())
        unknown = [o for o in wanted if o not in registered]
        if unknown:
            raise UsageError(f"--ops names unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(registered))}")
    options = Options(trials=args.trials, threshold=args.threshold, objective=args.objective, seed=args.seed,
                      budget_s=args.budget, mode=args.mode, ops=wanted,
                      search_rounds=args.rounds, final_rounds=args.final_rounds, bench_s=args.bench_seconds or None,
                      retries=args.retries, pause_s=args.pause)
    storage_url = args.storage or default_storage()
    try:
        storage = open_storage(storage_url)
    except ValueError as e:
        raise UsageError(f"--storage {storage_url}: {e}") from None
    console.print(f"tuning {args.profile} on backend [bold]{backend.name}[/] ({backend.fingerprint()['device']}); "
                  f"studies in {storage_url}")
    memory = int(args.trial_memory * 2**30) if args.trial_memory else default_memory_limit()
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False, disable=args.quiet) as progress:
        bar = _Bar(progress, args.trials, console)
        bench = IsolatedBench(backend.name, options.measure(), args.imports, args.trial_timeout, memory, bar.note)
        search = Search(storage, backend.fingerprint(), trials=args.trials, seed=args.seed,
                        lease_s=bench.longest_s)
        try:
            tuner = Tuner(backend, search, bench, options, listener=bar)
            table = tuner.tune(profile)
        except KeyboardInterrupt:
            bench.close(wait_s=0)  # the trial under way is dropped: it runs again on resume
            raise
        finally:
            bench.close()
    elapsed = time.perf_counter() - t0
    cut = _undecided(table)
    if cut and _finished(Path(args.output)):  # a cut run, like an interrupted one, keeps the table it would replace
        console.print(report.summary(table, title="this run's table (not written)"))
        console.print(f"[red]the --budget ran out before {cut} of {len(table.entries)} entries were decided; "
                      f"{args.output} is left as it was: run again to finish them (the studies resume), or write "
                      f"to a new file with -o[/]")
        return 1
    table.save(args.output)
    console.print(report.summary(table, title=f"dispatch table {args.output}"))
    n_kernel = sum(e.impl is not None for e in table.entries)
    console.print(f"wrote {args.output}: {len(table.entries)} entries, {n_kernel} kernel, "
                  f"{len(table.entries) - n_kernel} compiler, in {elapsed:.1f} s"
                  + ("" if tuner.measured_anything else " (all results from storage, nothing measured)")
                  + (f"; the --budget ran out before {cut} of them were decided: run again to finish them (the "
                     "studies resume)" if cut else ""))
    disturbed = sum(bool((e.measured.get("calibration") or {}).get("disturbed")) for e in table.entries)
    if disturbed:
        console.print(f"[red]{disturbed} of {len(table.entries)} entries were measured on a disturbed machine "
                      "(DISTURBED): their kernels are not enabled; run again on a quiet machine to measure them "
                      "again[/]")
    return 0


def _undecided(table) -> int:
    """How many of ``table``'s entries a --budget cut short (the tuner's reason says so)."""
    return sum("budget exhausted" in e.reason for e in table.entries)


def _finished(path: Path) -> bool:
    """Whether ``path`` holds a table that decided every key."""
    try:
        return not _undecided(load_table(path))
    except (OSError, FormatError):
        return False


# -- show / diff (plain data: no torch) --------------------------------------------------------------------------


def cmd_show(args, console: Console) -> int:
    table = load_table(args.table)
    fp = ", ".join(f"{k}={v}" for k, v in table.fingerprint.items())
    console.print(f"[bold]{args.table}[/] created {table.created}\nfingerprint: {fp}")
    console.print(report.summary(table))
    console.print(report.reasons(table))
    flagged = report.flags(table)
    if flagged:
        console.print(f"[red]{len(flagged)} entr{'y' if len(flagged) == 1 else 'ies'} flagged[/]: stale entries "
                      "are ignored by dispatch (run `nki-autotune run` again); disturbed ones were measured while "
                      "other work shared the machine")
    return 0


def cmd_diff(args, console: Console) -> int:
    old, new = load_table(args.old), load_table(args.new)
    t, changed = report.diff(old, new)
    console.print(t)
    console.print(f"{changed} decision(s) changed")
    return 0


# -- list -------------------------------------------------------------------------------------------------------


def cmd_list(args, console: Console) -> int:
    registry = _heavy(args.imports)
    t = RichTable(title="ops and impls")
    for col in ("op", "impl", "backend", "config space", "default"):
        t.add_column(col, overflow="fold")
    for op in registry.ops().values():
        if not op.impls:
            t.add_row(op.name, "-", "-", "-", "-")
        for impl in op.impls.values():
            space = "; ".join(f"{k}: {list(v)}" for k, v in impl.space.items()) or "(no parameters)"
            t.add_row(op.name, impl.name, impl.backend, space, ", ".join(f"{k}={v}" for k, v in impl.default.items()))
    console.print(t)
    b = RichTable(title="backends")
    b.add_column("backend")
    b.add_column("status", overflow="fold")
    for name, be in registry.backends().items():
        why = be.why_unavailable()
        b.add_row(name, "[green]available[/]" if why is None else f"[yellow]unavailable[/]: {why}")
    console.print(b)
    from ..kernels import nkilib

    if nkilib.WHY_NOT is None:
        names = ", ".join(i.qualname for op in registry.ops().values() for i in op.impls.values()
                          if i.module.startswith(nkilib.__name__ + "."))
        console.print(f"NKI Library (nkilib, {nkilib.origin()}): {names}")
        for module, why in nkilib.MISSING.items():
            console.print(f"NKI Library: [yellow]no impl from kernels/nkilib/{module}.py[/]: {why}")
    else:
        console.print(f"NKI Library: [yellow]no impls[/]: {nkilib.WHY_NOT}")
    s = RichTable(title="switches (read at import)")
    s.add_column("variable")
    s.add_column("value")
    s.add_column("meaning", overflow="fold")
    cur = registry.settings()
    s.add_row(KERNELS, cur.kernels, "all ops: auto (follow the table) | off | on")
    for name in registry.ops():
        var = KERNEL_OP + name.upper()
        s.add_row(var, cur.per_op.get(name, "(unset)"), f"{name}: auto | off | on | an impl name")
    s.add_row(TABLE, os.pathsep.join(cur.tables) or "(unset)", "dispatch tables, first match wins")
    s.add_row(STRICT, "1" if cur.strict else "0", "a foreign table or a stale entry is an error, not a warning")
    s.add_row(RECORD, cur.record or "(unset)", "record a profile of this run, written at exit")
    s.add_row(RECORD_SAMPLES, "1" if cur.record_samples else "0", "also save real inputs of data-dependent ops")
    s.add_row(LOG, "1" if cur.log else "0", "log each distinct dispatch decision once (logger nki_autotune.dispatch)")
    console.print(s)
    known = (KERNELS, TABLE, STRICT, RECORD, RECORD_SAMPLES, LOG)
    for k, v in switch_variables().items():
        if k not in known and not k.startswith(KERNEL_OP):
            console.print(f"[yellow]note[/]: {k}={v} is not a variable nki-autotune reads")
    return 0


# -- record -----------------------------------------------------------------------------------------------------


def cmd_record(args, console: Console) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command and not args.merge:
        raise UsageError("record needs a command to run, e.g. nki-autotune record -o profile.yaml -- python train.py; "
                         "or profiles to merge: nki-autotune record -o merged.yaml --merge a.yaml b.yaml")
    _writable(args.output, "-o")
    registry = _heavy(args.imports)
    out = Path(args.output).resolve()
    given = [load_profile(p, registry.ops()) for p in args.merge or ()]
    if command:
        recorded = _record_run(command, out, args, registry, console)
        if recorded is None:
            return 1
        given += recorded
    profile = given[0] if len(given) == 1 and not args.merge else merge(given, out)
    profile.save(out)
    console.print(f"wrote {args.output}: {len(profile.sites)} call sites, "
                  f"{len(profile.keys(registry.ops()))} unique keys")
    return 0


def _ops_named(path: Path) -> set[str]:
    """The ops a profile's sites name, read as plain data (they need not be registered here)."""
    data = load_yaml(path, "profile")
    sites = data.get("sites") if isinstance(data, dict) else None
    return {str(s.get("op")) for s in sites or () if isinstance(s, dict)}


def _record_run(command: list[str], out: Path, args, registry, console: Console) -> list | None:
    """Run ``command`` recording into ``out`` (and its ranks' files); their profiles, None if it wrote none.

    The profiles of an earlier recording are renamed aside (``*.before-record``), so that only this run's are
    merged, and renamed back if this run writes none: the command failed, could not start, or was interrupted
    (Ctrl-C, or SIGTERM from a scheduler). Killed outright, the earlier ones are still there, under that name."""
    aside = {}
    for p in [out, *out.parent.glob(f"{out.stem}.rank*{out.suffix}")]:
        if p.exists():
            aside[p] = p.with_name(p.name + ".before-record")
            os.replace(p, aside[p])
    kept = f"; {args.output} is left as it was" if out in aside else ""
    done = False
    terminate = _on_sigterm()
    try:
        samples = args.samples or read_settings(os.environ).record_samples  # --samples, or the variable
        env = {**os.environ, RECORD: str(out), RECORD_SAMPLES: "1" if samples else "0"}
        console.print(f"recording {' '.join(command)} -> {args.output}")
        try:
            rc = subprocess.run(command, env=env).returncode
        except OSError as e:  # no such program, not executable
            raise UsageError(f"cannot run {command[0]!r}: {e.strerror or e}{kept}") from None
        if -rc in (signal.SIGINT, signal.SIGTERM):  # the same Ctrl-C or SIGTERM reached the command first
            raise Interrupted(-rc)
        ranks = sorted(out.parent.glob(f"{out.stem}.rank*{out.suffix}"))
        written = ([out] if out.exists() else []) + ranks
        if rc != 0 or not written:
            console.print(f"[red]the command exited with code {rc}{kept}[/]" if rc != 0 else
                          "[red]no profile was written: the command made no call of a pack op (does it import "
                          f"nki_autotune.kernels?){kept}[/]")
            return None
        unknown = sorted(set().union(*map(_ops_named, written)) - set(registry.ops()))
        if unknown:  # the command registered ops of its own: this process needs their module to read them
            done = True  # this run's profiles are kept as written: run and record --merge read them with --import
            raise UsageError(
                f"the command recorded calls of {', '.join(unknown)}, which no module imported here registers: "
                f"pass the module that registers {'it' if len(unknown) == 1 else 'them'} with --import MODULE (to "
                f"record and to run); this run's profiles are left as written: "
                f"{', '.join(str(p) for p in written)}")
        profiles = [load_profile(p, registry.ops()) for p in written]
        if ranks:
            console.print(f"merging the profiles of {len(ranks)} ranks: {', '.join(p.name for p in ranks)}")
        done = True
        return profiles
    finally:
        terminate()
        if not done:
            for p in [out, *out.parent.glob(f"{out.stem}.rank*{out.suffix}")]:
                p.unlink(missing_ok=True)
        for p, a in aside.items():
            if done:
                a.unlink(missing_ok=True)
            else:
                os.replace(a, p)


def _on_sigterm() -> Callable[[], None]:
    """Until the returned function is called, SIGINT and SIGTERM unwind as ``Interrupted`` (so ``finally`` blocks
    run), even where SIGINT was ignored when this process started (a job started in the background by a shell
    that has no job control)."""
    def stop(signum, frame):
        raise Interrupted(signum)

    try:
        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        return lambda: None

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore


# -- check ------------------------------------------------------------------------------------------------------


def cmd_check(args, console: Console) -> int:
    registry = _heavy(args.imports)
    from .check import check_all, isolated
    from .measure import MeasureOptions
    from .worker import Worker, default_memory_limit

    names = tuple(o.strip() for o in args.ops.split(",")) if args.ops else None
    if names:
        unknown = [o for o in names if o not in registry.ops()]
        if unknown:
            raise UsageError(f"--ops names unknown op(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(registry.ops()))}")
    memory = int(args.memory * 2**30) if args.memory else default_memory_limit()
    worker = Worker("cpu", MeasureOptions(seed=args.seed), args.imports, memory, limits=("--timeout", "--memory"))
    try:
        rows = check_all(names, seed=args.seed, run=isolated(worker, args.timeout),
                         listener=lambda r: r.died and console.print(f"[red]{r.impl}[/]: {r.error}"))
    finally:
        worker.close(wait_s=0)
    t = RichTable(title="numerics against the float64 reference")
    for col in ("impl", "run", "inputs", "mode", "error", "tolerance", "result"):
        t.add_column(col, overflow="fold")
    failed = 0
    for r in rows:
        shapes = " ".join(short(s) + (f":{s.dtype}" if s else "") for s in r.key.inputs)
        if r.skipped:
            t.add_row(r.impl, "-", shapes, r.key.mode, "-", "-", f"[dim]skipped: {r.skipped}[/]")
            continue
        failed += not r.passed
        err = f"{r.result.rel_err:.1e}" if r.result else "-"
        tol = f"{r.result.tolerance:.0e}" if r.result else "-"
        t.add_row(r.impl, r.how or "native", shapes, r.key.mode, err, tol,
                  "[green]pass[/]" if r.passed else f"[red]FAIL[/] {r.error or (r.result.detail if r.result else '')}")
    console.print(t)
    console.print(f"{len(rows) - failed - sum(bool(r.skipped) for r in rows)} passed, {failed} failed")
    return 1 if failed else 0


# -- verify -----------------------------------------------------------------------------------------------------


def cmd_verify(args, console: Console) -> int:
    _not_recording("verify")
    _heavy(args.imports)
    from .verify import StepError, Verifier, load_step

    if args.prune and not args.output:
        raise UsageError("--prune needs -o OUT, the table to write")
    if args.output and not args.prune:
        raise UsageError("-o OUT writes the pruned table: it needs --prune")
    if args.prune and args.no_ablate:
        raise UsageError("--prune sends back the entries that do not pay with each switched off alone: "
                         "it needs the ablation that --no-ablate skips")
    for path, option in ((args.output, "-o"), (args.json, "--json")):
        if path:
            _writable(path, option)
    from ..registry.switches import load_checked

    # a foreign or stale table cannot be verified: it is not what dispatch would follow
    table = load_checked(args.table, read_settings({STRICT: "1"}),
                         strict_because="verify measures only a table that is current on this machine")
    try:
        make_step = load_step(args.step)
    except StepError as e:
        raise UsageError(str(e)) from None
    v = Verifier(table, args.table, make_step, rounds=args.rounds, warmup=args.warmup, seed=args.seed,
                 tolerance=args.tolerance, ablate=not args.no_ablate,
                 say=lambda s: None if args.quiet else console.print(f"[dim]{s}[/]"))
    try:
        r = v.run()
    except StepError as e:
        raise UsageError(str(e)) from None
    t = RichTable(title=f"full training step under {args.table}")
    for col in ("variant", "ms/step (median)", "peak MiB", "loss vs off", "gradients vs off"):
        t.add_column(col)
    for name, row in r.variants.items():
        num = r.numerics.get(name, {})
        fmt = "{:.1e}".format
        t.add_row(name, f"{row['ms_per_step']:.2f}", _mib(row["peak_mib"]),
                  fmt(num["loss_rel_diff"]) if "loss_rel_diff" in num else "-",
                  fmt(num["grad_rel_diff"]) if "grad_rel_diff" in num else "-")
    console.print(t)
    for name, s in r.speedups.items():
        ratio = r.memory.get(name)
        console.print(f"  speedup of {name}: {s['speedup']:.3f}x (95% CI {s['ci95'][0]:.3f}-{s['ci95'][1]:.3f})"
                      + ("" if ratio is None else f"; peak memory {ratio:.3f}x"))
    if r.entries:
        e = RichTable(title="each enabled entry switched off alone (saving: the step without it minus with it)",
                      caption="the only enabled entry switched off leaves what every kernel off runs: timed as off"
                      if any(row["timed_as"] for row in r.entries) else None)
        for col in ("#", "entry", "impl", "predicted ms/step", "realized ms/step", "95% CI", "realized peak MiB",
                    "pays"):
            e.add_column(col, overflow="fold")
        for row in r.entries:
            lo, hi = row["realized_ci95"]
            pred = "-" if row["predicted_ms"] is None else f"{row['predicted_ms']:+.3f}"
            peak = "-" if row["realized_peak_mib"] is None else f"{row['realized_peak_mib']:+.4g}"
            spans = " (median; its interval spans 0)" if lo <= 0 <= hi and row["objective"] == "time" else ""
            e.add_row(str(row["entry"]), row["key"], row["impl"], pred, f"{row['realized_ms']:+.3f}",
                      f"{lo:+.3f} to {hi:+.3f}", peak, ("[green]yes[/]" if row["kept"] else "[red]no[/]") + spans
                      + (" (objective memory)" if row["objective"] == "memory" else ""))
        console.print(e)
    console.print(("[red]" if r.slower else "[green]") + r.verdict + "[/]")
    if r.ceiling and r.ceiling["speedup"]:
        c = r.ceiling
        def ms(x: float) -> str:  # a tiny step's 0.04 ms is not 0.0
            return f"{x:.1f}" if x >= 1 else f"{x:.2g}"

        console.print(f"the table's call sites, measured apart, take {ms(c['compiler_ms'])} ms of the "
                      f"{ms(c['step_ms'])} ms step under the compiler: a table can make this step about "
                      f"{c['speedup']:.3f}x faster at most"
                      + ("; the table measured faster than that, so in this step its call sites cost more than "
                         "they did measured apart (memory the step's other work faults in or evicts, or a machine "
                         "busy while the tuner measured): the bound does not hold here" if c["exceeded"] else ""))
    if not r.numerics_ok:
        console.print(f"[red]numerics: a variant's loss or gradients differ from every kernel off by more than "
                      f"{args.tolerance:g}[/] (is STEP deterministic: same seeds, same data each call?)")
    if args.json:
        atomic_write_text(args.json, json.dumps(r.as_json(), indent=2))
    if args.prune:
        pruned = v.pruned(r)
        pruned.save(args.output)
        dropped = sum(1 for row in r.entries if not row["kept"])
        console.print(f"wrote {args.output}: {dropped} entr{'y' if dropped == 1 else 'ies'} sent back to the compiler")
    return 1 if r.slower or not r.numerics_ok else 0


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


# -- selftest ---------------------------------------------------------------------------------------------------


def cmd_selftest(args, console: Console) -> int:
    from .selftest import selftest

    code, text = selftest(seed=args.seed, output=args.output)
    console.print(text, markup=False, highlight=False)
    return code


# -- entry point --------------------------------------------------------------------------------------------------


def _at_least(lo: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` no smaller than ``lo`` (a bad one exits 2, naming the option)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {text}")
        return value

    return parse


def _positive(text: str) -> float:
    """An argparse type: a number above 0."""
    value = _at_least(0.0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _imports(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (repeatable): it registers its own ops and impls")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nki-autotune",
        description="Benchmark kernels against the compiler at every call site of a model "
                    "and write the dispatch table that enables each kernel only where it wins.",
    )
    p.add_argument("--version", action="version", version=f"nki-autotune {dist_version('nki-autotune')}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="tune a profile and write a dispatch table")
    r.add_argument("profile")
    r.add_argument("-o", "--output", required=True, help="dispatch table to write (YAML)")
    r.add_argument("--backend", choices=("auto", "cpu", "neuron"), default="auto")
    r.add_argument("--mode", choices=("training", "inference", "both"), default=None,
                   help="tune every key in this mode (default: as recorded, training where the call needed a "
                        "gradient)")
    r.add_argument("--trials", type=_at_least(1), default=16, help="trials per (key, impl) study")
    r.add_argument("--budget", type=_at_least(0.0, float), default=None, help="seconds; no new trial starts after it")
    r.add_argument("--storage", default=None, help="Optuna storage URL (sqlite, postgresql, mysql, journal:///path)")
    r.add_argument("--ops", default=None, help="comma-separated ops to tune (default: all)")
    r.add_argument("--threshold", type=_at_least(1.0, float), default=1.05,
                   help="minimum median speedup to enable a kernel (objective time)")
    r.add_argument("--objective", choices=OBJECTIVES, default="time",
                   help="time: enable a kernel where it is faster; memory: never more memory, then the time rule: "
                        "where it lowers the peak memory of its region by 10%% or more and is not slower (its speedup "
                        "interval does not lie below 1), or where its peak is not above the compiler's and it is "
                        "faster by the time rule")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--rounds", type=_at_least(3), default=15, help="timed rounds per trial")
    r.add_argument("--final-rounds", type=_at_least(MIN_ROUNDS), default=40,
                   help=f"timed rounds of the final comparison (at least {MIN_ROUNDS}: see verify --rounds)")
    r.add_argument("--bench-seconds", type=_at_least(0.0, float), default=3.0,
                   help=f"a trial's rounds stop once they add up to this many seconds (and number {MIN_ROUNDS}), the "
                        "final comparison's at four times it: a half-second region is not timed 40 times (0: "
                        "always --rounds and --final-rounds)")
    r.add_argument("--retries", type=_at_least(0), default=2,
                   help="times a key is measured again when the machine was disturbed while measuring it")
    r.add_argument("--pause", type=_at_least(0.0, float), default=5.0, help="seconds to wait before measuring again")
    r.add_argument("--trial-timeout", type=_positive, default=300.0,
                   help="seconds one trial may take (compile, numerics, timing); a hung config is killed")
    r.add_argument("--trial-memory", type=_positive, default=None,
                   help="GiB the worker may use before a trial is stopped (default: 80%% of the machine's memory)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _imports(r)
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("show", help="print a dispatch table")
    s.add_argument("table")
    s.set_defaults(fn=cmd_show)

    d = sub.add_parser("diff", help="compare two dispatch tables")
    d.add_argument("old")
    d.add_argument("new")
    d.set_defaults(fn=cmd_diff)

    ls = sub.add_parser("list", help="ops, impls, backends and switch variables")
    _imports(ls)
    ls.set_defaults(fn=cmd_list)

    rec = sub.add_parser("record", help="record a profile of a command: record -o PROFILE -- COMMAND ...")
    rec.add_argument("-o", "--output", required=True)
    rec.add_argument("--samples", action="store_true", help="save real inputs of data-dependent ops beside it")
    rec.add_argument("--merge", nargs="+", metavar="PROFILE", help="profiles to merge into the output")
    _imports(rec)
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rec.set_defaults(fn=cmd_record)

    c = sub.add_parser("check", help="numerics of every impl against the float64 reference")
    c.add_argument("--ops", default=None)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--timeout", type=_positive, default=300.0,
                   help="seconds one impl may take on one example (as run's --trial-timeout); a hung impl is killed")
    c.add_argument("--memory", type=_positive, default=None,
                   help="GiB the worker may use (as run's --trial-memory; default: 80%% of the machine's memory)")
    _imports(c)
    c.set_defaults(fn=cmd_check)

    v = sub.add_parser("verify", help="time the full training step under a table, every kernel off and on")
    v.add_argument("table")
    v.add_argument("step", help="path/to/file.py:function or package.module:function returning a step callable")
    v.add_argument("--rounds", type=_at_least(MIN_ROUNDS), default=20,
                   help=f"interleaved rounds of every variant (at least {MIN_ROUNDS}: fewer rounds bound no median "
                        "with 95%% confidence)")
    v.add_argument("--warmup", type=_at_least(0), default=3, help="untimed steps of each variant first")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--tolerance", type=_positive, default=1e-3,
                   help="largest relative difference of loss and gradients against every kernel off")
    v.add_argument("--no-ablate", action="store_true", help="skip switching each entry off alone")
    v.add_argument("--prune", action="store_true", help="send entries that do not pay back to the compiler")
    v.add_argument("-o", "--output", default=None, help="the pruned table to write (with --prune)")
    v.add_argument("--json", default=None, help="write every number as JSON to this file")
    v.add_argument("-q", "--quiet", action="store_true")
    _imports(v)
    v.set_defaults(fn=cmd_verify)


    st = sub.add_parser("selftest", help="on a Trainium host: confirm the whole neuron path, print a report")
    st.add_argument("-o", "--output", default=None, help="also write the report (Markdown) here")
    st.add_argument("--seed", type=int, default=0)
    st.set_defaults(fn=cmd_selftest)
    return p


UNWRAPPED = 10_000
"""The width of output that is not a terminal: no table is that wide, so none folds a cell."""


def _console() -> Console:
    """A terminal's width where stdout is a terminal. Elsewhere (logs, CI, a pipe) nothing is wrapped: messages and
    paths stay whole on their lines, and tables take the width they need, whether or not the environment asks for
    colours (``FORCE_COLOR``, ``TTY_COMPATIBLE``, which make rich take a pipe for an 80-column terminal)."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        tty = False
    return Console(highlight=False) if tty else Console(highlight=False, width=UNWRAPPED, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "fn", None) is None:
        p.print_help()
        return 2
    console = _console()

    def err(msg: str) -> None:
        print(f"nki-autotune {args.cmd}: {msg}", file=sys.stderr)
    try:
        return args.fn(args, console)
    except (UsageError, FormatError, SettingsError) as e:
        err(f"error: {e}")
        return 2
    except KeyboardInterrupt as e:
        err("interrupted" + ("; finished trials are kept in storage, and the table is written only once every key "
                             "is complete: run the same command again to resume" if args.cmd == "run" else ""))
        return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
    except Exception as e:
        err(f"failed: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
