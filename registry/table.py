"""The dispatch table (docs/design.md §5.2): which impl and config serve each call-site key.

Plain data: reading, validating and writing a table imports neither torch nor any kernel, so ``show`` and
``diff`` stay light. Validation against the registered ops (op names, attributes, impls, configs) happens
when the ops are given, as dispatch and the autotuner do.

Each input of an entry is ``[shape, dtype]``, with a third item ``{strides: [...], grad: ...}`` only where the
input is not contiguous, or where its gradient is not what the mode implies (training: every floating-point
input's; inference: none); ``null`` where an optional tensor was left out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from . import yamlio
from .sources import source_hash
from .specs import DTYPES, MODES, TRAINING, Key, TensorSpec, attrs_key, none_refused
from .yamlio import Fields, Flow, FlowDict, FormatError

if TYPE_CHECKING:
    from .op import Impl, Op

VERSION = 2
READS = (1, 2)
"""Version 2 added each input's layout and gradient (``{strides, grad}``) and an entry's ``module``."""
_TOP = ("version", "fingerprint", "created", "entries")
_ENTRY = ("op", "mode", "inputs", "attrs", "sites", "choice", "source", "module", "measured", "reason")
_LAYOUT = ("strides", "grad")
OBJECTIVES = ("time", "memory")
"""What the tuner decided an entry for (``measured.objective``; absent in older tables: time)."""


def _default_grad(mode: str, spec: TensorSpec) -> bool:
    return mode == TRAINING and spec.is_float


def input_yaml(mode: str, spec: TensorSpec | None) -> Flow | None:
    """One input as written in a table: ``[shape, dtype]``, plus its layout and gradient where not the default;
    None (``null``) for an absent optional tensor."""
    if spec is None:
        return None
    item = Flow([Flow(spec.shape), spec.dtype])
    extra = FlowDict()
    if spec.strides is not None:
        extra["strides"] = Flow(spec.strides)
    if spec.requires_grad != _default_grad(mode, spec):
        extra["grad"] = spec.requires_grad
    if extra:
        item.append(extra)
    return item


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
    """Hash of the source the entry was tuned for (``registry.sources``): other source makes the entry stale."""
    measured: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    module: str | None = None
    """The module holding the kernel ``source`` hashes, so the hash can be checked without importing it."""

    def to_yaml(self) -> dict[str, Any]:
        k = self.key
        out: dict[str, Any] = {
            "op": k.op,
            "mode": k.mode,
            "inputs": Flow(input_yaml(k.mode, s) for s in k.inputs),
            "attrs": FlowDict(k.attrs),
            "sites": Flow(self.sites),
            "choice": "compiler" if self.impl is None else FlowDict(impl=self.impl, config=FlowDict(self.config)),
        }
        if self.source:
            out["source"] = self.source
        if self.module:
            out["module"] = self.module
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
    stale: dict[int, str] = field(default_factory=dict)
    """Index -> why: entries tuned for other kernel source, or whose config the kernel does not take here, which
    dispatch ignores (set by the loader)."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Index in the file -> what it names: entries of ops or impls not registered when it was read."""
    positions: list[int] = field(default_factory=list)
    """Each entry's index in the file, where skipped entries make it differ from its index in ``entries``."""

    def __post_init__(self) -> None:
        self._index = {e.key: i for i, e in enumerate(self.entries)}

    def position(self, i: int) -> int:
        """The index in the file of ``entries[i]``: what messages name."""
        return self.positions[i] if self.positions else i

    def lookup(self, key: Key) -> Entry | None:
        i = self._index.get(key)
        return None if i is None else self.entries[i]

    def index(self, key: Key) -> int | None:
        return self._index.get(key)

    def nearest(self, key: Key) -> tuple[int, list[str]] | None:
        """The entry of the same op that differs from ``key`` in the fewest fields: (its index, those fields)."""
        best = None
        for i, e in enumerate(self.entries):
            if e.key.op == key.op:
                diff = key.differences(e.key)
                if best is None or len(diff) < len(best[1]):
                    best = (i, diff)
        return best

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


def parse_table(data: Any, path: str, ops: Mapping[str, Op] | None = None, unknown_ops: str = "error") -> Table:
    """Validate ``data`` (parsed YAML) against the format, and against the registered ``ops`` when given.

    ``unknown_ops="skip"`` leaves out the entries of ops or impls not registered (yet), listing them in
    ``Table.skipped``: dispatch loads tables when the pack is imported, before a user's module registers its own
    ops and impls."""
    if isinstance(data, dict) and "sites" in data and "entries" not in data:
        raise TableError(f"{path}: a profile (it has 'sites'), not a dispatch table: nki-autotune run tunes it "
                         "into one")
    try:
        top = Fields(data, path)
        top.unknown(_TOP)
        version = top.get("version", int)
        if version not in READS:
            raise top.fail("version", f"unsupported version {version}; this nki-autotune reads versions "
                                      f"{', '.join(map(str, READS))}")
        fingerprint = top.get("fingerprint", dict)
        if not isinstance(fingerprint.get("backend"), str):
            raise top.fail("fingerprint.backend", "missing; it names the backend the table was tuned on")
        created = str(top.get("created", (str, datetime), default=""))
        raw_entries = top.get("entries", list)
        entries, seen, skipped, positions = [], {}, {}, []
        for i, raw in enumerate(raw_entries):
            missing = _unregistered(raw, ops) if unknown_ops == "skip" and ops is not None else None
            if missing is not None:
                skipped[i] = missing
                continue
            entry = _parse_entry(raw, f"{path}: entries[{i}]", ops, lenient=unknown_ops == "skip")
            if entry.key in seen:
                raise TableError(f"{path}: entries[{i}]: same op, mode, inputs and attrs as entries[{seen[entry.key]}]")
            seen[entry.key] = i
            entries.append(entry)
            positions.append(i)
    except TableError:
        raise
    except FormatError as e:
        raise _fail(e) from None
    return Table(fingerprint=dict(fingerprint), entries=entries, created=created, path=path, skipped=skipped,
                 positions=positions)


def _measured(f: Fields) -> dict[str, Any]:
    """The ``measured`` field, free-form but for the values readers format (``show``, ``diff``, dispatch)."""
    m = dict(f.get("measured", dict, default={}))

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for k in ("kernel_us", "compiler_us", "speedup", "tolerance", "kernel_peak_mib", "compiler_peak_mib"):
        # null where nothing was measured; the peaks are absent from tables written before they were measured
        if m.get(k) is not None and not number(m[k]):
            raise f.fail(f"measured.{k}", f"expected a number, got {m[k]!r}")
    ci = m.get("ci95")
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(number(v) for v in ci)):
        raise f.fail("measured.ci95", f"expected [low, high], two numbers, got {ci!r}")
    if m.get("objective", "time") not in OBJECTIVES:
        raise f.fail("measured.objective", f"{m['objective']!r} is not allowed; use one of: {', '.join(OBJECTIVES)}")
    if not isinstance(m.get("calibration") or {}, dict):
        raise f.fail("measured.calibration", f"expected a mapping, got {m['calibration']!r}")
    return m


def _unregistered(raw: Any, ops: Mapping[str, Op]) -> str | None:
    """What an entry names that is not registered (its op, or the impl it chose), if anything."""
    if not isinstance(raw, dict):
        return None
    op = ops.get(raw.get("op"))
    if op is None:
        return f"op {raw.get('op')!r}"
    choice = raw.get("choice")
    impl = choice.get("impl") if isinstance(choice, dict) else None
    if isinstance(impl, str) and impl not in op.impls:
        return f"impl {op.name}.{impl}"
    return None


def _parse_input(f: Fields, j: int, item: Any, mode: str, op: Op | None) -> TensorSpec | None:
    field = f"inputs[{j}]"
    if item is None:
        why = None if op is None else none_refused(op, j)
        if why is not None:
            raise f.fail(field, why)
        return None
    if not isinstance(item, list) or len(item) not in (2, 3):
        raise f.fail(field, f"expected [shape, dtype] or [shape, dtype, {{strides: [...], grad: ...}}], got {item!r}")
    shape, dtype = f.shape(item[0], field), f.dtype(item[1], field, DTYPES)
    extra = Fields(item[2] if len(item) == 3 else {}, f"{f.where}: field '{field}'")
    extra.unknown(_LAYOUT)
    strides = extra.get("strides", list, default=None)
    if strides is not None:
        if len(strides) != len(shape) or not all(isinstance(v, int) and not isinstance(v, bool) for v in strides):
            raise f.fail(f"{field}.strides", f"expected {len(shape)} integers (one per dim), got {strides!r}")
        strides = tuple(strides)
    spec = TensorSpec(shape, dtype, strides)
    return TensorSpec(shape, dtype, strides, extra.get("grad", bool, default=_default_grad(mode, spec)))


def _parse_entry(raw: Any, where: str, ops: Mapping[str, Op] | None, lenient: bool = False) -> Entry:
    f = Fields(raw, where)
    name = f.get("op", str)
    op = None
    if ops is not None:
        if name not in ops:
            raise f.fail("op", f"unknown op {name!r}; known ops: {', '.join(sorted(ops)) or 'none'}")
        op = ops[name]
    f.where = f"{where} ({name})"
    f.unknown(_ENTRY)
    mode = f.get("mode", str)
    if mode not in MODES:
        raise f.fail("mode", f"{mode!r} is not allowed; use one of: {', '.join(MODES)}")
    inputs = f.get("inputs", list)
    if op is not None and len(inputs) != len(op.tensors):
        raise f.fail("inputs", f"{name} takes {len(op.tensors)} tensors ({', '.join(op.tensors)}), got {len(inputs)}")
    specs = tuple(_parse_input(f, j, item, mode, op) for j, item in enumerate(inputs))
    if op is None:
        key = Key(name, mode, specs, attrs_key(f.get("attrs", dict, default={})))
    else:
        key = Key.of(op, specs, f.attrs("attrs", dict(op.attrs), dict(op.defaults)), mode)  # older tables: defaults
    choice = f.get("choice", (str, dict), what="'compiler' or {impl: NAME, config: {...}}")
    impl, config = None, {}
    if isinstance(choice, str):
        if choice != "compiler":
            raise f.fail("choice", f"{choice!r} is not allowed; use 'compiler' or {{impl: NAME, config: {{...}}}}")
    else:
        c = Fields(choice, f"{f.where}: field 'choice'")
        c.unknown(("impl", "config"))
        impl = c.get("impl", str)
        config = c.get("config", dict, default={})
        for p, v in config.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise f.fail(f"choice.config.{p}", f"expected an integer, got {v!r}")
        if op is not None:
            if impl not in op.impls:
                raise f.fail("choice.impl", f"unknown impl {impl!r} of {name}; it has: {', '.join(op.impls) or 'none'}")
            space = op.impls[impl].space
            for p in config:
                if p not in space and not lenient:  # for dispatch, such an entry is stale (config_problem)
                    raise f.fail(f"choice.config.{p}", f"not a parameter of {name}.{impl}; it has: {', '.join(space)}")
            config = {**op.impls[impl].default, **config}
    sites = f.get("sites", list, default=[])
    return Entry(
        key=key, impl=impl, config=config, sites=[str(s) for s in sites],
        source=f.get("source", str, default=None),
        measured=_measured(f),
        reason=str(f.get("reason", str, default="")),
        module=f.get("module", str, default=None),
    )


def load_table(path: str | os.PathLike, ops: Mapping[str, Op] | None = None, unknown_ops: str = "error") -> Table:
    """Read and validate a table file (against ``ops`` when given); errors name the file, entry and field."""
    try:
        data = yamlio.load(path, "dispatch table")
    except FormatError as e:
        raise _fail(e) from None
    return parse_table(data, str(path), ops, unknown_ops)


def config_problem(entry: Entry, impl: Impl) -> str | None:
    """Why ``entry``'s config is not one ``impl`` takes at its key on this machine (a value outside its space,
    such as more threads than this machine's pool, or one its constraint refuses), or None."""
    for p, v in entry.config.items():
        if p not in impl.space:
            return f"its config names {p}, not a parameter of {impl.qualname} ({', '.join(impl.space)})"
        if v not in impl.space[p]:
            takes = ", ".join(map(str, impl.space[p]))
            return f"its config {p}={v} is not a value {impl.qualname} takes here ({takes})"
    if not impl.allows(entry.config, entry.key):
        return f"{impl.qualname}'s constraint does not admit its config {entry.config} at this key"
    return None


def stale_reason(entry: Entry, module: str | None) -> str | None:
    """Why ``entry`` no longer applies to the kernel in ``module`` (its source changed), or None.

    An entry that records no source makes no claim about it and is never stale."""
    if not entry.source or not module:
        return None
    now = source_hash(module)
    if now is None:
        return f"the source of {module} cannot be found to check it"
    if now != entry.source:
        return f"tuned for source {entry.source}, {module} is now {now}"
    return None


def fingerprint_mismatch(table: Table, current: Mapping[str, Any] | None) -> str | None:
    """Why ``table`` was not tuned on this machine, or None if it was."""
    if current is None:
        return f"its backend {table.fingerprint.get('backend')!r} is not available here"
    for k, v in current.items():
        if str(table.fingerprint.get(k)) != str(v):
            return f"fingerprint field '{k}' is {table.fingerprint.get(k)!r} in the table, {v!r} here"
    return None
