"""The ``nki-autotune`` command: run, show, diff, list, record, check.

Exit codes: 0 success, 1 the work failed, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from ..registry import (
    FormatError,
    SettingsError,
    backends,
    default_backend,
    get_backend,
    load_profile,
    load_table,
    ops,
    settings,
    switch_variables,
)
from ..registry.env import KERNEL_OP, KERNELS, RECORD, RECORD_SAMPLES, STRICT, TABLE
from . import report
from .check import check_all
from .search import Search, default_storage, open_storage
from .tuner import Listener, Options, Tuner


class UsageError(Exception):
    """Bad usage or bad input: exit code 2."""


def _version() -> str:
    try:
        return importlib.metadata.version("nki-autotune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _pack() -> None:
    import nki_autotune.kernels  # noqa: F401  (registers every op)


# -- run --------------------------------------------------------------------------------------------------------


class _Bar(Listener):
    def __init__(self, progress: Progress, trials: int):
        self.p, self.trials = progress, trials
        self.best: float | None = None

    def keys(self, n):
        self.sites = self.p.add_task("sites", total=n)
        self.trial = self.p.add_task("trials", total=None)

    def key_started(self, key, sites):
        self.best = None
        self.p.update(self.trial, completed=0, total=self.trials,
                      description=f"{key.op} {' '.join('x'.join(map(str, s.shape)) for s in key.inputs)} {key.mode}")

    def trial_done(self, key, impl, result, best):
        if not result.failed:
            self.best = max(self.best or 0.0, result.speedup)
        self.p.advance(self.trial)
        best_s = f"best {self.best:.2f}x" if self.best else "no passing config yet"
        self.p.update(self.sites, description=f"sites  ({best_s})")

    def key_done(self, key, entry):
        self.p.advance(self.sites)


def cmd_run(args, console: Console) -> int:
    _pack()
    registered = ops()
    if args.backend == "auto":
        backend = default_backend()
    else:
        backend = get_backend(args.backend)
        why = backend.why_unavailable()
        if why is not None:
            raise UsageError(f"backend {args.backend} is not available here: {why}")
    profile = load_profile(args.profile, registered)
    wanted = None
    if args.ops:
        wanted = tuple(o.strip() for o in args.ops.split(",") if o.strip())
        unknown = [o for o in wanted if o not in registered]
        if unknown:
            raise UsageError(f"--ops names unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(registered))}")
    if args.threshold < 1.0:
        raise UsageError(f"--threshold must be at least 1.0, got {args.threshold}")
    options = Options(trials=args.trials, threshold=args.threshold, seed=args.seed, budget_s=args.budget,
                      mode=None if args.mode == "profile" else args.mode, ops=wanted,
                      search_rounds=args.rounds, final_rounds=args.final_rounds)
    storage_url = args.storage or default_storage()
    search = Search(open_storage(storage_url), backend.fingerprint(), trials=args.trials, seed=args.seed)
    console.print(f"tuning {args.profile} on backend [bold]{backend.name}[/] ({backend.fingerprint()['device']}); "
                  f"studies in {storage_url}")
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False, disable=args.quiet) as progress:
        tuner = Tuner(backend, search, options, listener=_Bar(progress, args.trials))
        table = tuner.tune(profile, args.output)
    table.save(args.output)
    elapsed = time.perf_counter() - t0
    console.print(report.summary(table, title=f"dispatch table {args.output}"))
    n_kernel = sum(e.impl is not None for e in table.entries)
    console.print(f"wrote {args.output}: {len(table.entries)} entries, {n_kernel} kernel, "
                  f"{len(table.entries) - n_kernel} compiler, in {elapsed:.1f} s"
                  + ("" if tuner.measured_anything else " (all results from storage, nothing measured)"))
    return 0


# -- show / diff ------------------------------------------------------------------------------------------------


def cmd_show(args, console: Console) -> int:
    _pack()
    table = load_table(args.table, ops())
    fp = ", ".join(f"{k}={v}" for k, v in table.fingerprint.items())
    console.print(f"[bold]{args.table}[/] created {table.created}\nfingerprint: {fp}")
    console.print(report.summary(table))
    console.print(report.reasons(table))
    return 0


def cmd_diff(args, console: Console) -> int:
    _pack()
    old, new = load_table(args.old, ops()), load_table(args.new, ops())
    t, changed = report.diff(old, new)
    console.print(t)
    console.print(f"{changed} decision(s) changed")
    return 0


# -- list -------------------------------------------------------------------------------------------------------


def cmd_list(args, console: Console) -> int:
    _pack()
    t = RichTable(title="ops and impls")
    for col in ("op", "impl", "backend", "config space", "default"):
        t.add_column(col, overflow="fold")
    for op in ops().values():
        if not op.impls:
            t.add_row(op.name, "-", "-", "-", "-")
        for impl in op.impls.values():
            space = "; ".join(f"{k}: {list(v)}" for k, v in impl.space.items())
            t.add_row(op.name, impl.name, impl.backend, space, ", ".join(f"{k}={v}" for k, v in impl.default.items()))
    console.print(t)
    b = RichTable(title="backends")
    b.add_column("backend")
    b.add_column("status", overflow="fold")
    for name, be in backends().items():
        why = be.why_unavailable()
        b.add_row(name, "[green]available[/]" if why is None else f"[yellow]unavailable[/]: {why}")
    console.print(b)
    s = RichTable(title="switches (read at import)")
    s.add_column("variable")
    s.add_column("value")
    s.add_column("meaning", overflow="fold")
    cur = settings()
    s.add_row(KERNELS, cur.kernels, "all ops: auto (follow the table) | off | on")
    for name in ops():
        var = KERNEL_OP + name.upper()
        s.add_row(var, cur.per_op.get(name, "(unset)"), f"{name}: auto | off | on | an impl name")
    s.add_row(TABLE, os.pathsep.join(cur.tables) or "(unset)", "dispatch tables, first match wins")
    s.add_row(STRICT, "1" if cur.strict else "0", "a foreign table is an error, not a warning")
    s.add_row(RECORD, cur.record or "(unset)", "record a profile of this run, written at exit")
    s.add_row(RECORD_SAMPLES, "1" if cur.record_samples else "0", "also save real inputs of data-dependent ops")
    console.print(s)
    extra = {k: v for k, v in switch_variables().items()
             if k not in (KERNELS, TABLE, STRICT, RECORD, RECORD_SAMPLES) and not k.startswith(KERNEL_OP)}
    for k, v in extra.items():
        console.print(f"[yellow]note[/]: {k}={v} is not a variable nki-autotune reads")
    return 0


# -- record -----------------------------------------------------------------------------------------------------


def cmd_record(args, console: Console) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("record needs a command to run, e.g. nki-autotune record -o profile.yaml -- python train.py")
    out = Path(args.output).resolve()
    if out.exists():
        out.unlink()
    env = {**os.environ, RECORD: str(out), RECORD_SAMPLES: "1" if args.samples else "0"}
    console.print(f"recording {' '.join(command)} -> {args.output}")
    rc = subprocess.run(command, env=env).returncode
    if rc != 0:
        console.print(f"[red]the command exited with code {rc}[/]")
        return 1
    if not out.exists():
        console.print("[red]no profile was written: the command made no call of a pack op "
                      "(does it import nki_autotune.kernels?)[/]")
        return 1
    _pack()
    profile = load_profile(out, ops())
    console.print(f"wrote {args.output}: {len(profile.sites)} call sites, "
                  f"{len(profile.keys(ops()))} unique keys")
    return 0


# -- check ------------------------------------------------------------------------------------------------------


def cmd_check(args, console: Console) -> int:
    _pack()
    names = tuple(o.strip() for o in args.ops.split(",")) if args.ops else None
    if names:
        unknown = [o for o in names if o not in ops()]
        if unknown:
            raise UsageError(f"--ops names unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(ops()))}")
    rows = check_all(names, seed=args.seed)
    t = RichTable(title="numerics against the float64 reference")
    for col in ("impl", "run", "inputs", "mode", "error", "tolerance", "result"):
        t.add_column(col, overflow="fold")
    failed = 0
    for r in rows:
        shapes = " ".join(f"{'x'.join(map(str, s.shape))}:{s.dtype}" for s in r.key.inputs)
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


# -- selftest ---------------------------------------------------------------------------------------------------


def cmd_selftest(args, console: Console) -> int:
    from .selftest import selftest

    code, text = selftest(seed=args.seed, output=args.output)
    console.print(text, markup=False, highlight=False)
    return code


# -- entry point --------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nki-autotune",
        description="Benchmark kernels against the compiler at every call site of a model "
                    "and write the dispatch table that enables each kernel only where it wins.",
    )
    p.add_argument("--version", action="version", version=f"nki-autotune {_version()}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="tune a profile and write a dispatch table")
    r.add_argument("profile")
    r.add_argument("-o", "--output", required=True, help="dispatch table to write (YAML)")
    r.add_argument("--backend", choices=("auto", "cpu", "neuron"), default="auto")
    r.add_argument("--mode", choices=("profile", "training", "inference", "both"), default="profile",
                   help="profile: training where the profile's inputs require grad")
    r.add_argument("--trials", type=int, default=16, help="trials per (key, impl) study")
    r.add_argument("--budget", type=float, default=None, help="seconds; no new trial starts after it")
    r.add_argument("--storage", default=None, help="Optuna storage URL (sqlite, postgresql, mysql, journal:///path)")
    r.add_argument("--ops", default=None, help="comma-separated ops to tune (default: all)")
    r.add_argument("--threshold", type=float, default=1.05, help="minimum median speedup to enable a kernel")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--rounds", type=int, default=15, help="timed rounds per trial")
    r.add_argument("--final-rounds", type=int, default=40, help="timed rounds of the final comparison")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("show", help="print a dispatch table")
    s.add_argument("table")
    s.set_defaults(fn=cmd_show)

    d = sub.add_parser("diff", help="compare two dispatch tables")
    d.add_argument("old")
    d.add_argument("new")
    d.set_defaults(fn=cmd_diff)

    ls = sub.add_parser("list", help="ops, impls, backends and switch variables")
    ls.set_defaults(fn=cmd_list)

    rec = sub.add_parser("record", help="record a profile of a command: record -o PROFILE -- COMMAND ...")
    rec.add_argument("-o", "--output", required=True)
    rec.add_argument("--samples", action="store_true", help="save real inputs of data-dependent ops beside it")
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rec.set_defaults(fn=cmd_record)

    c = sub.add_parser("check", help="numerics of every impl against the float64 reference")
    c.add_argument("--ops", default=None)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(fn=cmd_check)

    st = sub.add_parser("selftest", help="on a Trainium host: confirm the whole neuron path, print a report")
    st.add_argument("-o", "--output", default=None, help="also write the report (Markdown) here")
    st.add_argument("--seed", type=int, default=0)
    st.set_defaults(fn=cmd_selftest)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "fn", None) is None:
        p.print_help()
        return 2
    console = Console(highlight=False)
    if not console.is_terminal:  # logs and CI: wide enough that tables do not fold
        console = Console(highlight=False, width=180)

    def err(msg: str) -> None:
        print(f"nki-autotune {args.cmd}: {msg}", file=sys.stderr)
    try:
        return args.fn(args, console)
    except (UsageError, FormatError, SettingsError) as e:
        err(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        err("interrupted; finished trials are kept in storage")
        return 130
    except Exception as e:
        err(f"failed: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
