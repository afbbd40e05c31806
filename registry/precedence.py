"""Which path a call takes: per-op variable > global variable > table > compiler path (docs/design.md §4).

``resolve`` is the whole rule, and it depends only on the call's key, the devices of its tensors and the
switches in force (a ``switches.View``); dispatch caches what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .backend import backends
from .env import SettingsError
from .op import Impl, Op
from .specs import Key
from .switches import View
from .table import Entry, Table

COMPILER = "compiler"
KERNEL = "kernel"


@dataclass(frozen=True)
class Explanation:
    """Which path a call takes and why; ``table`` and ``entry`` name what decided, where a table did."""

    op: str
    key: Key
    path: str
    impl: str | None
    config: Mapping[str, int] = field(default_factory=dict)
    reason: str = ""
    table: str | None = None
    entry: int | None = None
    args: tuple[int, ...] = ()
    """What the impl's operator takes after the attributes (``Impl.call_args``): the config values, and the needs
    of a ``forward_needs`` impl."""

    @property
    def choice(self) -> tuple[str, tuple[int, ...]] | None:
        if self.impl is None:
            return None
        return self.impl, self.args

    def __str__(self) -> str:
        if self.impl is None:
            return f"{self.key.label()}: compiler path ({self.reason})"
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items())
        return f"{self.key.label()}: kernel {self.op}.{self.impl} [{cfg}] ({self.reason})"


def usable(impl: Impl, key: Key, devices: set[str]) -> str | None:
    """None when ``impl`` can serve the call, else why not."""
    backend = backends().get(impl.backend)
    if backend is None or not backend.available():
        why = backend.why_unavailable() if backend is not None else "unknown backend"
        return f"backend {impl.backend} unavailable: {why}"
    if devices != {backend.device}:
        return f"inputs on {', '.join(sorted(devices))}, backend {impl.backend} runs on {backend.device}"
    return impl.supports(key.inputs, key.attr_dict)


def _find(view: View, key: Key) -> tuple[Table, int, Entry] | None:
    """The first table's entry for ``key`` that is not stale; else the first stale one, which the caller names
    as ignored. A stale entry is as good as absent, so it does not hide a later table's valid one."""
    first_stale = None
    for t in view.tables:
        i = t.index(key)
        if i is None:
            continue
        if i not in t.stale:
            return t, i, t.entries[i]
        first_stale = first_stale or (t, i, t.entries[i])
    return first_stale


def _miss(view: View, key: Key) -> str:
    """Why no table has an entry for ``key``, naming the nearest entry and how it differs."""
    if not view.tables:
        return "no table loaded"
    notes = []
    for t in view.tables:
        near = t.nearest(key)
        if near is not None:
            i, diff = near
            notes.append(f"nearest in {t.path} is entries[{t.position(i)}], which differs in {', '.join(diff)}")
        notes += [f"{t.path} entries[{i}] names {what}, which is not registered: ignored"
                  for i, what in t.skipped.items() if what.startswith(f"impl {key.op}.")]
    where = ", ".join(str(t.path) for t in view.tables)
    return f"no entry for this key in {where}" + (f" ({'; '.join(notes)})" if notes else "")


def resolve(op: Op, key: Key, devices: set[str], view: View) -> Explanation:
    """Apply the switches (per-op > global), then the tables, then the compiler path."""
    value, var = view.settings.switch(op.name)
    found = _find(view, key)
    table, index, entry = found if found is not None else (None, None, None)
    stale = table.stale.get(index) if table is not None else None
    where = {} if table is None else {"table": table.path, "entry": table.position(index)}

    def compiler(reason: str, **decided) -> Explanation:
        return Explanation(op.name, key, COMPILER, None, {}, reason, **decided)

    def kernel(impl: Impl, config: Mapping[str, int] | None, reason: str, **decided) -> Explanation:
        why = usable(impl, key, devices)
        if why is not None:
            return compiler(f"{impl.qualname} declines: {why}", **decided)
        cfg = dict(config) if config is not None else impl.config_at(key)
        if cfg is None:
            return compiler(f"{impl.qualname} has no config its constraint admits at this shape", **decided)
        if config is None:
            fitted = {p: v for p, v in cfg.items() if impl.default.get(p) != v}
            reason += ", the first config its constraint admits at this shape (not the default)" \
                if cfg not in (impl.default, impl.default_at(key)) else \
                ", default config" + (f" fitted to the call ({', '.join(f'{p}={v}' for p, v in fitted.items())})"
                                      if fitted else "")
        cfg = {p: cfg[p] for p in impl.space}  # the order the custom op takes them in
        return Explanation(op.name, key, KERNEL, impl.name, cfg, reason, **decided, args=impl.call_args(cfg, key))

    if value == "off":
        return compiler(f"{var}=off")
    named = f"table {table.path} entries[{table.position(index)}]" if table is not None else ""
    if stale is not None:
        entry, ignored = None, f"{named} is stale and ignored: {stale}"
    else:
        ignored = ""
    if value == "auto":
        if entry is None:
            return compiler(ignored or _miss(view, key))
        if entry.impl is None:
            return compiler(f"{named} chose the compiler: {entry.reason}", **where)
        return kernel(op.impls[entry.impl], entry.config, f"{named}: {entry.reason}", **where)
    if value == "on":
        if entry is not None and entry.impl is not None:
            exp = kernel(op.impls[entry.impl], entry.config, f"{var}=on, impl and config from {named}", **where)
            if exp.impl is not None:
                return exp
        declined = []
        for impl in op.impls.values():
            exp = kernel(impl, None, f"{var}=on")
            if exp.impl is not None:
                return exp
            declined.append(exp.reason)
        return compiler(f"{var}=on but no impl serves this call: " + "; ".join(declined) if declined
                        else f"{var}=on but {op.name} has no impl")
    impl = op.impls.get(value)
    if impl is None:  # a per-op switch set before the op's module registered its impls
        allowed = ", ".join(("auto", "off", "on", *op.impls))
        raise SettingsError(f"{var}={value!r} is not allowed; use one of: {allowed}")
    if entry is not None and entry.impl == value:
        return kernel(impl, entry.config, f"{var}={value}, config from {named}", **where)
    return kernel(impl, None, f"{var}={value}")
