"""The dispatch table (DESIGN §5): which impl and config serve each call-site key."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import yamlio
from .ops import Op
from .specs import DTYPES, MODES, Key
from .yamlio import Fields, Flow, FlowDict, FormatError

VERSION = 1
_TOP = ("version", "fingerprint", "created", "entries")
_ENTRY = ("op", "mode", "inputs", "attrs", "sites", "choice", "source", "measured", "reason")


class TableError(FormatError):
    """A dispatch table is malformed, or does not belong to this machine (strict mode)."""


@dataclass
class Entry:
    key: Key
    impl: str | None
    """None: the compiler path."""
    config: dict[str, int] = field(default_factory=dict)
    sites: list[str] = field(default_factory=list)
    source: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    def to_yaml(self) -> dict[str, Any]:
        k = self.key
        out: dict[str, Any] = {
            "op": k.op,
            "mode": k.mode,
            "inputs": Flow(Flow([Flow(s), d]) for s, d in k.inputs),
            "attrs": FlowDict(k.attrs),
            "sites": Flow(self.sites),
            "choice": "compiler" if self.impl is None else FlowDict(impl=self.impl, config=FlowDict(self.config)),
        }
        if self.source:
            out["source"] = self.source
        if self.measured:
            out["measured"] = FlowDict(self.measured)
        out["reason"] = self.reason
        return out


@dataclass
class Table:
    fingerprint: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)
    created: str = ""
    path: str | None = None

    def __post_init__(self) -> None:
        self._index = {e.key: e for e in self.entries}

    def lookup(self, key: Key) -> Entry | None:
        return self._index.get(key)

    def to_yaml(self) -> str:
        created = self.created or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return yamlio.dump({
            "version": VERSION,
            "fingerprint": FlowDict(self.fingerprint),
            "created": created,
            "entries": [e.to_yaml() for e in self.entries],
        })

    def save(self, path: str | os.PathLike) -> None:
        yamlio.atomic_write_text(path, self.to_yaml())


def _fail(e: FormatError) -> TableError:
    return TableError(str(e))


def parse_table(data: Any, path: str, ops: Mapping[str, Op]) -> Table:
    """Validate ``data`` (parsed YAML) against the format and the registered ops."""
    try:
        top = Fields(data, path)
        top.unknown(_TOP)
        version = top.get("version", int)
        if version != VERSION:
            raise top.fail("version", f"unsupported version {version}; this nki-autotune reads version {VERSION}")
        fingerprint = top.get("fingerprint", dict)
        if not isinstance(fingerprint.get("backend"), str):
            raise top.fail("fingerprint.backend", "missing; it names the backend the table was tuned on")
        created = str(top.get("created", (str, datetime), default=""))
        raw_entries = top.get("entries", list)
        entries, seen = [], {}
        for i, raw in enumerate(raw_entries):
            entry = _parse_entry(raw, f"{path}: entries[{i}]", ops)
            if entry.key in seen:
                raise TableError(f"{path}: entries[{i}]: same op, mode, inputs and attrs as entries[{seen[entry.key]}]")
            seen[entry.key] = i
            entries.append(entry)
    except TableError:
        raise
    except FormatError as e:
        raise _fail(e) from None
    return Table(fingerprint=dict(fingerprint), entries=entries, created=created, path=path)


def _parse_entry(raw: Any, where: str, ops: Mapping[str, Op]) -> Entry:
    f = Fields(raw, where)
    name = f.get("op", str)
    if name not in ops:
        raise f.fail("op", f"unknown op {name!r}; known ops: {', '.join(sorted(ops)) or 'none'}")
    op = ops[name]
    f.where = f"{where} ({name})"
    f.unknown(_ENTRY)
    mode = f.get("mode", str)
    if mode not in MODES:
        raise f.fail("mode", f"{mode!r} is not allowed; use one of: {', '.join(MODES)}")
    inputs = f.get("inputs", list)
    if len(inputs) != len(op.tensors):
        raise f.fail("inputs", f"{name} takes {len(op.tensors)} tensors ({', '.join(op.tensors)}), got {len(inputs)}")
    specs = []
    for j, item in enumerate(inputs):
        if not isinstance(item, list) or len(item) != 2:
            raise f.fail(f"inputs[{j}]", f"expected [shape, dtype], got {item!r}")
        specs.append((f.shape(item[0], f"inputs[{j}]"), f.dtype(item[1], f"inputs[{j}]", DTYPES)))
    attrs = f.attrs("attrs", dict(op.attrs))
    key = Key(name, mode, tuple(specs), tuple(sorted(attrs.items())))
    choice = f.get("choice", (str, dict), what="'compiler' or {impl: NAME, config: {...}}")
    impl, config = None, {}
    if isinstance(choice, str):
        if choice != "compiler":
            raise f.fail("choice", f"{choice!r} is not allowed; use 'compiler' or {{impl: NAME, config: {{...}}}}")
    else:
        c = Fields(choice, f"{f.where}: field 'choice'")
        c.unknown(("impl", "config"))
        impl = c.get("impl", str)
        if impl not in op.impls:
            raise f.fail("choice.impl", f"unknown impl {impl!r} of {name}; it has: {', '.join(op.impls) or 'none'}")
        space = op.impls[impl].space
        config = c.get("config", dict, default={})
        for p, v in config.items():
            if p not in space:
                raise f.fail(f"choice.config.{p}", f"not a parameter of {name}.{impl}; it has: {', '.join(space)}")
            if not isinstance(v, int) or isinstance(v, bool):
                raise f.fail(f"choice.config.{p}", f"expected an integer, got {v!r}")
        config = {**op.impls[impl].default, **config}
    sites = f.get("sites", list, default=[])
    return Entry(
        key=key, impl=impl, config=config, sites=[str(s) for s in sites],
        source=f.get("source", str, default=None),
        measured=dict(f.get("measured", dict, default={})),
        reason=str(f.get("reason", str, default="")),
    )


def load_table(path: str | os.PathLike, ops: Mapping[str, Op]) -> Table:
    """Read and validate a table file; errors name the file, entry and field."""
    try:
        data = yamlio.load(path, "dispatch table")
    except FormatError as e:
        raise _fail(e) from None
    return parse_table(data, str(path), ops)


def fingerprint_mismatch(table: Table, current: Mapping[str, Any] | None) -> str | None:
    """Why ``table`` was not tuned on this machine, or None if it was."""
    if current is None:
        return f"its backend {table.fingerprint.get('backend')!r} is not available here"
    for k, v in current.items():
        if str(table.fingerprint.get(k)) != str(v):
            return f"fingerprint field '{k}' is {table.fingerprint.get(k)!r} in the table, {v!r} here"
    return None
