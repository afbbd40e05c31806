"""``nki-autotune list``: the ops, impls, backends and switch variables of this process."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table as RichTable

from ...registry import switch_variables
from ...registry.env import KERNEL_OP, KERNELS, LOG, RECORD, RECORD_SAMPLES, STRICT, TABLE
from .common import add_imports, heavy


def cmd_list(args, console: Console) -> int:
    registry = heavy(args.imports)
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
    from ...kernels import nkilib

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


def add_parser(sub) -> None:
    ls = sub.add_parser("list", help="ops, impls, backends and switch variables")
    add_imports(ls)
    ls.set_defaults(fn=cmd_list)
