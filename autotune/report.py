"""Tables for people: the run summary, ``show``, ``diff`` and ``list``."""

from __future__ import annotations

from typing import Any

from rich.table import Table as RichTable

from ..registry import Entry, Key, Table


def _shapes(key: Key) -> str:
    return " ".join(("x".join(map(str, s.shape)) or "()") + ("ᵀ" if s.strides is not None else "")
                    for s in key.inputs) + f" {key.inputs[0].dtype}"


def _choice(e: Entry) -> str:
    if e.impl is None:
        return "[yellow]compiler[/]"
    cfg = ",".join(f"{k}={v}" for k, v in e.config.items())
    return f"[green]{e.impl}[/] {cfg}"


def _num(m: dict[str, Any], k: str, fmt: str = "{:.1f}") -> str:
    v = m.get(k)
    return "-" if v is None else fmt.format(v)


def summary(table: Table, title: str = "") -> RichTable:
    t = RichTable(title=title or None, show_lines=False)
    for col in ("op", "sites", "mode", "shapes", "kernel us", "compiler us", "speedup", "95% CI", "error", "decision"):
        t.add_column(col, overflow="fold")
    for e in table.entries:
        m = e.measured
        ci = m.get("ci95")
        sites = (e.sites[0] if e.sites else "-") + (f" +{len(e.sites) - 1}" if len(e.sites) > 1 else "")
        t.add_row(e.key.op, sites, e.key.mode, _shapes(e.key), _num(m, "kernel_us"), _num(m, "compiler_us"),
                  _num(m, "speedup", "{:.2f}x"), f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-",
                  _num(m, "rel_err", "{:.1e}") if isinstance(m.get("rel_err"), float) else "-", _choice(e))
    return t


def reasons(table: Table) -> RichTable:
    t = RichTable(show_header=True)
    t.add_column("#", justify="right")
    t.add_column("entry")
    t.add_column("reason", overflow="fold")
    for i, e in enumerate(table.entries):
        t.add_row(str(i), e.key.label(), e.reason)
    return t


def diff(old: Table, new: Table) -> tuple[RichTable, int]:
    """Entries whose decision, config or measured speedup changed; and how many changed decisions."""
    t = RichTable(title="dispatch table diff")
    for col in ("entry", "old", "new", "speedup old -> new"):
        t.add_column(col, overflow="fold")
    changed = 0
    keys = list(dict.fromkeys([e.key for e in old.entries] + [e.key for e in new.entries]))
    for k in keys:
        a, b = old.lookup(k), new.lookup(k)
        sa = _num(a.measured, "speedup", "{:.2f}x") if a else "-"
        sb = _num(b.measured, "speedup", "{:.2f}x") if b else "-"
        if a is None or b is None or (a.impl, a.config) != (b.impl, b.config):
            changed += 1
            t.add_row(k.label(), _choice(a) if a else "[dim]absent[/]", _choice(b) if b else "[dim]absent[/]",
                      f"{sa} -> {sb}")
        elif sa != sb:
            t.add_row(k.label(), _choice(a), "[dim]same[/]", f"{sa} -> {sb}")
    return t, changed
