"""Dispatch: each call of a pack op takes one impl's custom op, or the reference.

The decision depends only on static facts (shapes, strides, dtypes, devices,
whether a gradient is wanted, attributes), the switches and the loaded tables.
It is cached per key in eager mode; under ``torch.compile`` it is made once at
trace time (``assume_constant_result``), so the graph holds either the chosen
custom op or the reference, with no guard on the tables and no graph break.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import settings as _settings
from .backend import backends
from .ops import Impl, Op, get_op, ops
from .specs import Key, TensorSpec
from .table import Table, TableError, fingerprint_mismatch, load_table

COMPILER = "compiler"
KERNEL = "kernel"


@dataclass(frozen=True)
class Explanation:
    """Which path a call takes and why."""

    op: str
    key: Key
    path: str
    impl: str | None
    config: Mapping[str, int]
    reason: str

    @property
    def choice(self) -> tuple[str, tuple[int, ...]] | None:
        if self.impl is None:
            return None
        return self.impl, tuple(self.config.values())

    def __str__(self) -> str:
        if self.impl is None:
            return f"{self.key.label()}: compiler path ({self.reason})"
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items())
        return f"{self.key.label()}: kernel {self.op}.{self.impl} [{cfg}] ({self.reason})"


class _State:
    """What dispatch reads. ``generation`` names the (settings, tables) in force: compiled code guards on
    it, so a graph traced under other switches is not reused, and switching back finds it again."""

    tables: list[Table] | None = None
    generation: int = 0
    cache: dict[tuple, Explanation] = {}
    recorder: Any = None
    generations: dict[tuple, int] = {}
    loaded: dict[int, list[Table]] = {}


_state = _State()


# -- settings and tables --------------------------------------------------------------------------------------


def check_switches(s: _settings.Settings | None = None) -> None:
    """Per-op switches must name registered ops and impls."""
    s = s or _settings.settings()
    registered = ops()
    for name, value in s.per_op.items():
        var = _settings.KERNEL_OP + name.upper()
        if name not in registered:
            known = ", ".join(_settings.KERNEL_OP + n.upper() for n in sorted(registered))
            raise _settings.SettingsError(f"{var} names no registered op; known: {known}")
        impls = registered[name].impls
        if value not in _settings.MODES and value not in impls:
            allowed = ", ".join((*_settings.MODES, *impls))
            raise _settings.SettingsError(f"{var}={value!r} is not allowed; use one of: {allowed}")


def load_table_checked(path: str, s: _settings.Settings) -> Table | None:
    """A table, if tuned on this machine; else None with a warning, or an error under strict mode."""
    table = load_table(path, ops())
    backend = backends().get(table.fingerprint["backend"])
    current = backend.fingerprint() if backend is not None and backend.available() else None
    why = fingerprint_mismatch(table, current)
    if why is None:
        return table
    msg = f"dispatch table {path} was tuned on another machine: {why}"
    if s.strict:
        raise TableError(f"{msg} ({_settings.STRICT}=1)")
    warnings.warn(f"nki-autotune: ignoring {msg}; set {_settings.STRICT}=1 to make this an error", stacklevel=3)
    return None


def load_tables() -> list[Table]:
    """Load the tables named by ``NKI_AUTOTUNE_TABLE``; foreign ones are skipped with a warning."""
    s = _settings.settings()
    loaded = [t for t in (load_table_checked(p, s) for p in s.tables) if t is not None]
    _state.tables = loaded
    _new_generation()
    return loaded


def _new_generation() -> None:
    _state.generation = max(_state.generations.values(), default=_state.generation) + 1
    _state.generations[_settings.settings().ident()] = _state.generation
    _state.loaded[_state.generation] = _state.tables


def tables() -> list[Table]:
    if _state.tables is None:
        load_tables()
    return _state.tables


def reload_settings(env: Mapping[str, str] | None = None) -> _settings.Settings:
    """Read the switches again (from ``env``, default ``os.environ``) and reload the tables.

    Compiled regions see the change at their next call: they guard on the settings in force.
    """
    new = _settings.read_settings(os.environ if env is None else env)
    check_switches(new)
    old = _settings.settings()
    _settings._set(new)
    try:
        load_tables()
    except Exception:
        _settings._set(old)
        _state.tables = None
        raise
    return new


@contextmanager
def scope(**env: str) -> Iterator[_settings.Settings]:
    """Run a block under other switches, e.g. ``scope(NKI_AUTOTUNE_KERNELS="off")``; restored after.

    ``env`` holds ``NKI_AUTOTUNE_*`` variables that replace all of the process's ones. Entering the same
    switches again reuses the graphs compiled under them (A/B comparisons in one process).
    """
    new = _settings.read_settings(env)
    check_switches(new)
    saved = (_settings.settings(), _state.tables, _state.generation)
    _settings._set(new)
    try:
        gen = _state.generations.get(new.ident())
        if gen is None:
            load_tables()
        else:
            _state.tables, _state.generation = _state.loaded[gen], gen
        yield new
    finally:
        _settings._set(saved[0])
        _state.tables, _state.generation = saved[1], saved[2]


# -- the decision ----------------------------------------------------------------------------------------------


def _spec(raw: tuple) -> TensorSpec:
    shape, strides, dtype, device, requires_grad = raw
    spec = TensorSpec(tuple(shape), str(dtype).removeprefix("torch."), tuple(strides), device.type, requires_grad)
    return spec if not spec.is_contiguous else TensorSpec(spec.shape, spec.dtype, None, spec.device, requires_grad)


def _usable(impl: Impl, specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    """None when ``impl`` can serve the call, else why not."""
    backend = backends().get(impl.backend)
    if backend is None or not backend.available():
        why = backend.why_unavailable() if backend is not None else "unknown backend"
        return f"backend {impl.backend} unavailable: {why}"
    devices = {s.device for s in specs}
    if devices != {backend.device}:
        return f"inputs on {', '.join(sorted(devices))}, backend {impl.backend} runs on {backend.device}"
    return impl.supports(specs, attrs)


def _config_for(impl: Impl, key: Key, table_config: Mapping[str, int] | None) -> dict[str, int] | None:
    if table_config is not None:
        return dict(table_config)
    if impl.allows(impl.default, key):
        return dict(impl.default)
    allowed = impl.configs(key, key.mode)
    return allowed[0] if allowed else None


def resolve(op: Op, specs: tuple[TensorSpec, ...], attrs: dict) -> Explanation:
    """Apply the switches (per-op > global), then the tables, then the compiler path."""
    s = _settings.settings()
    mode = op.mode_of(specs) if torch.is_grad_enabled() else "inference"
    key = Key.of(op.name, mode, specs, attrs)
    value, var = s.switch(op.name)

    def compiler(reason: str) -> Explanation:
        return Explanation(op.name, key, COMPILER, None, {}, reason)

    def kernel(impl: Impl, config: Mapping[str, int] | None, reason: str) -> Explanation:
        why = _usable(impl, specs, attrs)
        if why is not None:
            return compiler(f"{impl.qualname} declines: {why}")
        cfg = _config_for(impl, key, config)
        if cfg is None:
            return compiler(f"{impl.qualname} has no config its constraint admits at this shape")
        return Explanation(op.name, key, KERNEL, impl.name, cfg, reason)

    if value == "off":
        return compiler(f"{var}=off")
    entry, table = None, None
    for t in tables():
        entry = t.lookup(key)
        if entry is not None:
            table = t
            break
    if value == "auto":
        if entry is None:
            where = "no table loaded" if not tables() else "no table entry for this key"
            return compiler(where)
        if entry.impl is None:
            return compiler(f"table {table.path} chose the compiler: {entry.reason}")
        return kernel(op.impls[entry.impl], entry.config, f"table {table.path}: {entry.reason}")
    if value == "on":
        if entry is not None and entry.impl is not None:
            exp = kernel(op.impls[entry.impl], entry.config, f"{var}=on, impl and config from table {table.path}")
            if exp.impl is not None:
                return exp
        declined = []
        for impl in op.impls.values():
            exp = kernel(impl, None, f"{var}=on, default config")
            if exp.impl is not None:
                return exp
            declined.append(exp.reason)
        return compiler(f"{var}=on but no impl serves this call: " + "; ".join(declined) if declined
                        else f"{var}=on but {op.name} has no impl")
    impl = op.impls[value]
    cfg = entry.config if entry is not None and entry.impl == value else None
    return kernel(impl, cfg, f"{var}={value}" + (f", config from table {table.path}" if cfg else ", default config"))


@torch.compiler.assume_constant_result
def decide(op_name: str, raw: tuple, attrs: tuple, grad: bool, generation: int) -> tuple[str, tuple[int, ...]] | None:
    """The choice for one call: None (reference) or (impl, config values). Constant under tracing."""
    k = (op_name, raw, attrs, grad, generation)
    exp = _state.cache.get(k)
    if exp is None:
        op = get_op(op_name)
        with torch.set_grad_enabled(grad):
            exp = resolve(op, tuple(_spec(r) for r in raw), op.attr_dict(attrs))
        _state.cache[k] = exp
    return exp.choice


def _raw(tensors: tuple) -> tuple:
    return tuple([(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors])


def call(op: Op, tensors: tuple, attrs: tuple) -> Any:
    """Run one call of ``op`` on the chosen path. The pack's public functions end here."""
    raw = _raw(tensors)
    if _state.recorder is not None and not torch.compiler.is_compiling():
        _state.recorder.log(op, tensors, attrs)
    choice = decide(op.name, raw, attrs, torch.is_grad_enabled(), _state.generation)
    if choice is None:
        return op.reference(*tensors, *attrs)
    impl = op.impls[choice[0]]
    out = impl.fwd_op(*tensors, *attrs, *choice[1])
    if op.outputs + impl.saved == 1:
        return out
    return out[0] if op.outputs == 1 else out[:op.outputs]


def explain(op: str | Op, *args: Any, **kwargs: Any) -> Explanation:
    """Which path ``op(*args, **kwargs)`` takes, and why (the call is not run)."""
    op = get_op(op) if isinstance(op, str) else op
    names = list(op.tensors) + list(op.attrs)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    missing = [n for n in op.tensors if n not in bound]
    if missing:
        raise TypeError(f"explain({op.name!r}, ...): missing tensor argument(s) {', '.join(missing)}")
    tensors = tuple(bound[n] for n in op.tensors)
    absent = [a for a in op.attrs if a not in bound and a not in op.defaults]
    if absent:
        raise TypeError(f"explain({op.name!r}, ...): missing attribute(s) {', '.join(absent)}")
    attrs = {a: bound.get(a, op.defaults.get(a)) for a in op.attrs}
    return resolve(op, tuple(_spec(r) for r in _raw(tensors)), attrs)
