"""``nki-autotune run``: tune a profile's keys and write the dispatch table."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ...registry import FormatError, load_profile, load_table
from ...registry.specs import short
from ...registry.table import OBJECTIVES
from .. import report
from ..stats import MIN_ROUNDS
from .common import UsageError, add_imports, at_least, heavy, not_recording, positive, writable


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


def cmd_run(args, console: Console) -> int:
    not_recording("tune")
    registry = heavy(args.imports)
    from ..search import Search, default_storage, open_storage
    from ..tuner import Options, Tuner
    from ..worker import IsolatedBench, default_memory_limit

    registered = registry.ops()
    if args.backend == "auto":
        backend = registry.default_backend()
    else:
        backend = registry.get_backend(args.backend)
        why = backend.why_unavailable()
        if why is not None:
            raise UsageError(f"backend {args.backend} is not available here: {why}")
    writable(args.output, "-o")
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


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="tune a profile and write a dispatch table")
    r.add_argument("profile")
    r.add_argument("-o", "--output", required=True, help="dispatch table to write (YAML)")
    r.add_argument("--backend", choices=("auto", "cpu", "neuron"), default="auto")
    r.add_argument("--mode", choices=("training", "inference", "both"), default=None,
                   help="tune every key in this mode (default: as recorded, training where the call needed a "
                        "gradient)")
    r.add_argument("--trials", type=at_least(1), default=16, help="trials per (key, impl) study")
    r.add_argument("--budget", type=at_least(0.0, float), default=None, help="seconds; no new trial starts after it")
    r.add_argument("--storage", default=None, help="Optuna storage URL (sqlite, postgresql, mysql, journal:///path)")
    r.add_argument("--ops", default=None, help="comma-separated ops to tune (default: all)")
    r.add_argument("--threshold", type=at_least(1.0, float), default=1.05,
                   help="minimum median speedup to enable a kernel (objective time)")
    r.add_argument("--objective", choices=OBJECTIVES, default="time",
                   help="time: enable a kernel where it is faster; memory: never more memory, then the time rule: "
                        "where it lowers the peak memory of its region by 10%% or more and is not slower (its speedup "
                        "interval does not lie below 1), or where its peak is not above the compiler's and it is "
                        "faster by the time rule")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--rounds", type=at_least(3), default=15, help="timed rounds per trial")
    r.add_argument("--final-rounds", type=at_least(MIN_ROUNDS), default=40,
                   help=f"timed rounds of the final comparison (at least {MIN_ROUNDS}: see verify --rounds)")
    r.add_argument("--bench-seconds", type=at_least(0.0, float), default=3.0,
                   help=f"a trial's rounds stop once they add up to this many seconds (and number {MIN_ROUNDS}), the "
                        "final comparison's at four times it: a half-second region is not timed 40 times (0: "
                        "always --rounds and --final-rounds)")
    r.add_argument("--retries", type=at_least(0), default=2,
                   help="times a key is measured again when the machine was disturbed while measuring it")
    r.add_argument("--pause", type=at_least(0.0, float), default=5.0, help="seconds to wait before measuring again")
    r.add_argument("--trial-timeout", type=positive, default=300.0,
                   help="seconds one trial may take (compile, numerics, timing); a hung config is killed")
    r.add_argument("--trial-memory", type=positive, default=None,
                   help="GiB the worker may use before a trial is stopped (default: 80%% of the machine's memory)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_imports(r)
    r.set_defaults(fn=cmd_run)
