"""Tables for people: the run summary, ``show`` and ``diff``. Plain data in, no torch."""

from __future__ import annotations

from typing import Any

from rich.table import Table as RichTable

from ..registry import Entry, Key, Table
from ..registry.specs import short
from ..registry.table import stale_reason


def _shapes(key: Key) -> str:
    """Shapes, with ``*`` on an input that is not contiguous and ``'`` on one whose gradient is not asked for
    in a training key (a frozen weight)."""
    def one(s) -> str:
        if s is None:
            return short(s)
        mark = ("*" if s.strides is not None else "") + ("'" if key.mode == "training" and s.is_float
                                                            and not s.requires_grad else "")
        return short(s) + mark

    return " ".join(one(s) for s in key.inputs) + f" {key.present[0].dtype}"


def flags(table: Table) -> dict[int, str]:
    """Entries a reader should not trust as they stand: stale (the kernel's source changed since tuning, read
    from the source files without importing them) or measured on a disturbed machine."""
    out = {}
    for i, e in enumerate(table.entries):
        notes = []
        stale = stale_reason(e, e.module)
        if stale:
            notes.append(f"stale: {stale}")
        disturbed = (e.measured.get("calibration") or {}).get("disturbed")
        if disturbed:
            notes.append(f"disturbed: {disturbed}")
        if notes:
            out[i] = "; ".join(notes)
    return out


def _choice(e: Entry) -> str:
    if e.impl is None:
        return "[yellow]compiler[/]"
    cfg = ",".join(f"{k}={v}" for k, v in e.config.items())
    return f"[green]{e.impl}[/] {cfg}"


def _num(m: dict[str, Any], k: str, fmt: str = "{:.1f}") -> str:
    v = m.get(k)
    return "-" if v is None else fmt.format(v)


def summary(table: Table, title: str = "") -> RichTable:
    marks = flags(table)
    t = RichTable(title=title or None, show_lines=False)
    for col in ("#", "op", "sites", "mode", "shapes", "kernel us", "compiler us", "speedup", "95% CI", "kernel MiB",
                "compiler MiB", "error", "decision"):
        t.add_column(col, overflow="fold")
    for i, e in enumerate(table.entries):
        m = e.measured
        ci = m.get("ci95")
        sites = (e.sites[0] if e.sites else "-") + (f" +{len(e.sites) - 1}" if len(e.sites) > 1 else "")
        note = ""
        if i in marks:
            note = " [red]" + " ".join(n.split(":")[0].upper() for n in marks[i].split("; ")) + "[/]"
        t.add_row(str(i), e.key.op, sites, e.key.mode, _shapes(e.key), _num(m, "kernel_us"), _num(m, "compiler_us"),
                  _num(m, "speedup", "{:.2f}x"), f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-",
                  _num(m, "kernel_peak_mib", "{:g}"), _num(m, "compiler_peak_mib", "{:g}"),
                  _num(m, "rel_err", "{:.1e}") if isinstance(m.get("rel_err"), float) else "-", _choice(e) + note)
    return t


def reasons(table: Table) -> RichTable:
    marks = flags(table)
    t = RichTable(show_header=True)
    t.add_column("#", justify="right")
    t.add_column("entry")
    t.add_column("reason", overflow="fold")
    for i, e in enumerate(table.entries):
        t.add_row(str(i), e.key.label(), e.reason + (f" [red]({marks[i]})[/]" if i in marks else ""))
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
