"""``nki-autotune show`` and ``diff``: tables read as plain data, without torch or the kernels."""

from __future__ import annotations

from rich.console import Console

from ...registry import load_table
from .. import report


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


def add_parser(sub) -> None:
    s = sub.add_parser("show", help="print a dispatch table")
    s.add_argument("table")
    s.set_defaults(fn=cmd_show)

    d = sub.add_parser("diff", help="compare two dispatch tables")
    d.add_argument("old")
    d.add_argument("new")
    d.set_defaults(fn=cmd_diff)
