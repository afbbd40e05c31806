"""``nki-autotune check``: the numerics of every impl on its op's examples, each in an isolated worker."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table as RichTable

from ...registry.specs import short
from .common import UsageError, add_imports, heavy, positive


def cmd_check(args, console: Console) -> int:
    registry = heavy(args.imports)
    from ..check import check_all, isolated
    from ..measure import MeasureOptions
    from ..worker import Worker, default_memory_limit

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


def add_parser(sub) -> None:
    c = sub.add_parser("check", help="numerics of every impl against the float64 reference")
    c.add_argument("--ops", default=None)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--timeout", type=positive, default=300.0,
                   help="seconds one impl may take on one example (as run's --trial-timeout); a hung impl is killed")
    c.add_argument("--memory", type=positive, default=None,
                   help="GiB the worker may use (as run's --trial-memory; default: 80%% of the machine's memory)")
    add_imports(c)
    c.set_defaults(fn=cmd_check)
