"""The switches in force: the settings and the tables they name, per context, and the generation that
compiled code guards on.

A ``View`` is one (settings, loaded tables) pair with a generation number. The process has one (read at
import, replaced by ``reload_settings``); ``scope()`` sets another for one context (thread or task) through
a ContextVar, so eager dispatch and ``explain`` in other threads are unaffected. Compiled code cannot read a
ContextVar: while tracing, dispatch reads ``guard.generation``, a plain attribute that Dynamo guards on, and
``scope()`` sets it too while entered. So a region traced under a scope is not reused outside it, and
entering the same switches again finds its graphs (the scope's view is reused); two threads running compiled
regions under different scopes at the same moment share that one attribute.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from torch.compiler import assume_constant_result

from . import env as _s
from .backend import backends
from .op import Impl, ops, registered
from .table import Entry, Table, TableError, config_problem, fingerprint_mismatch, load_table, stale_reason


@dataclass(frozen=True)
class View:
    settings: _s.Settings
    tables: tuple[Table, ...]
    generation: int
    ops: int = 0
    """``registered()`` when the tables were loaded (entries of later ops and impls wait for a new view)."""


class _Guard:
    generation = 0


guard = _Guard()
_process_settings: _s.Settings = _s.read_settings(os.environ)
_process: View | None = None
_scoped: ContextVar[View | None] = ContextVar("nki_autotune_switches", default=None)
_by_generation: dict[int, View] = {}
_by_ident: dict[tuple, View] = {}


def settings() -> _s.Settings:
    """The settings in force here: this context's ``scope()``, else those read at import or at the last
    ``reload_settings()``."""
    view = _scoped.get()
    return view.settings if view is not None else _process_settings


def current() -> View:
    """The view in force here; the process's is built (its tables loaded) at first use."""
    view = _scoped.get()
    if view is not None:
        return view
    global _process
    if _process is None or _process.ops != registered():
        _process = _view(_process_settings)
        guard.generation = _process.generation
    return _process


def view(generation: int) -> View:
    return _by_generation[generation]


@assume_constant_result
def ready() -> bool:
    """Brings the process's view up to date (new registrations, first use) before a trace reads ``guard``: run
    at trace time, never traced, so the generation the graph guards on is the one its decisions used."""
    current()
    return True


def _view(s: _s.Settings) -> View:
    """The view of ``s`` with its tables loaded now: the generation of the same switches, tables and registered
    ops, if one was made before (its graphs stay valid), else a new one."""
    tables = tuple(t for t in (load_checked(p, s) for p in s.tables) if t is not None)
    old = _by_ident.get(s.ident())
    if old is not None and old.ops == registered() and old.tables == tables:
        return old if old.settings == s else replace(old, settings=s)  # other settings (logging): same generation
    v = View(s, tables, max(_by_generation, default=0) + 1, registered())
    _by_generation[v.generation] = v
    _by_ident[s.ident()] = v
    return v


def check_switches(s: _s.Settings | None = None, registered_only: bool = False) -> None:
    """Per-op switches must name registered ops and impls. ``registered_only`` checks only what is registered
    so far (the pack's import: a user's module may register other ops and impls after it; dispatch refuses
    an impl still unknown at the call)."""
    s = s or settings()
    known = ops()
    for name, value in s.per_op.items():
        var = _s.KERNEL_OP + name.upper()
        if name not in known:
            if registered_only:
                continue
            names = ", ".join(_s.KERNEL_OP + n.upper() for n in sorted(known))
            raise _s.SettingsError(f"{var} names no registered op; known: {names}")
        impls = known[name].impls
        if value not in _s.MODES and value not in impls and not registered_only:
            allowed = ", ".join((*_s.MODES, *impls))
            raise _s.SettingsError(f"{var}={value!r} is not allowed; use one of: {allowed}")


_warned: set[int] = set()


def warn_unknown(view: View) -> None:
    """Once per view: per-op switches that name no registered op, and table entries of ops or impls not registered
    (a typo, or a module never imported)."""
    if view.generation in _warned:
        return
    for t in view.tables:
        if t.skipped:
            listed = "; ".join(f"entries[{i}] names {what}" for i, what in t.skipped.items())
            _complain(view.settings, f"dispatch table {t.path}: ignoring entries of what is not registered "
                                     f"(import the module that registers it before the first call): {listed}")
    _warned.add(view.generation)
    unknown = sorted(n for n in view.settings.per_op if n not in ops())
    if unknown:
        names = ", ".join(_s.KERNEL_OP + n.upper() for n in unknown)
        warnings.warn(f"nki-autotune: {names} name{'s' if len(unknown) == 1 else ''} no registered op; known: "
                      f"{', '.join(sorted(ops()))}", stacklevel=4)


def entry_impl(entry: Entry) -> Impl | None:
    """The impl an entry was tuned for: its choice, or for a compiler entry the best kernel it measured."""
    op = ops().get(entry.key.op)
    name = entry.impl or entry.measured.get("impl")
    return op.impls.get(name) if op is not None and isinstance(name, str) else None


def load_checked(path: str, s: _s.Settings, strict_because: str = f"{_s.STRICT}=1") -> Table | None:
    """A table, if tuned on this machine; else None with a warning, or an error under strict mode (the error
    ends with ``strict_because``: why strict applies).

    Entries tuned for other kernel source, or whose config the kernel does not take on this machine, are marked
    stale (``table.stale``): dispatch ignores them, with a warning here, or an error under strict mode."""
    table = load_table(path)  # its format first: a table from another machine may name what this one lacks
    backend = backends().get(table.fingerprint["backend"])
    current_fp = backend.fingerprint() if backend is not None and backend.available() else None
    why = fingerprint_mismatch(table, current_fp)
    if why is not None:
        _complain(s, f"ignoring dispatch table {path}, tuned on another machine: {why}", strict_because)
        return None
    table = load_table(path, ops(), unknown_ops="skip")
    for i, e in enumerate(table.entries):
        impl = entry_impl(e)
        reason = stale_reason(e, impl.module) if impl is not None else None
        if reason is None and e.impl is not None:
            chosen = ops()[e.key.op].impls[e.impl]
            if chosen.backend != table.fingerprint["backend"]:
                reason = (f"it names {chosen.qualname}, a kernel of backend {chosen.backend}, in a table tuned on "
                          f"backend {table.fingerprint['backend']}")
            else:
                reason = config_problem(e, chosen)
        if reason is not None:
            table.stale[i] = reason
    if table.stale:
        listed = "; ".join(f"entries[{table.position(i)}] {table.entries[i].key.label()}: {r}"
                           for i, r in table.stale.items())
        _complain(s, f"dispatch table {path}: ignoring {len(table.stale)} stale entr"
                     f"{'y' if len(table.stale) == 1 else 'ies'} (tuned for a kernel source or a machine that is not "
                     f"this one's; run nki-autotune run again): {listed}", strict_because)
    return table


def _complain(s: _s.Settings, msg: str, strict_because: str = f"{_s.STRICT}=1") -> None:
    if s.strict:
        raise TableError(f"{msg} ({strict_because})")
    warnings.warn(f"nki-autotune: {msg}; set {_s.STRICT}=1 to make this an error", stacklevel=4)


def reload_settings(env: Mapping[str, str] | None = None) -> _s.Settings:
    """Read the switches again (from ``env``, default ``os.environ``) and reload the tables they name.

    Compiled regions see the change at their next call: they guard on the generation in force, which is the
    earlier one where the switches, the tables' contents and the registered ops are all as they were then (their
    graphs are reused). A bad value or table raises and changes nothing.
    """
    global _process, _process_settings
    new = _s.read_settings(os.environ if env is None else env)
    check_switches(new)
    v = _view(new)
    _process_settings, _process = new, v
    guard.generation = current().generation
    return new


def tables() -> list[Table]:
    """The tables in force here."""
    return list(current().tables)


@contextmanager
def scope(**env: str) -> Iterator[_s.Settings]:
    """Run a block under other switches, e.g. ``scope(NKI_AUTOTUNE_KERNELS="off")``; restored after.

    ``env`` holds ``NKI_AUTOTUNE_*`` variables that replace all of the process's ones, in this context only.
    Entering the same switches again reuses their tables and the graphs compiled under them.
    """
    new = _s.read_settings(env)
    check_switches(new)
    v = _by_ident.get(new.ident())
    if v is None or v.ops != registered():
        v = _view(new)
    elif v.settings != new:  # the same switches and tables, other settings (logging): the same generation
        v = replace(v, settings=new)
    token = _scoped.set(v)
    guard.generation = v.generation
    try:
        yield new
    finally:
        _scoped.reset(token)
        guard.generation = current().generation  # the enclosing switches, as reloaded meanwhile
