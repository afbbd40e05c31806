"""The switches of docs/design.md §4, read once into a frozen object.

Compiled code must never read ``os.environ``: a variable read at trace time would
be baked into the graph without a guard. Everything reads ``settings()`` instead,
and only ``reload_settings()`` looks at the environment again (``registry.switches``
holds the settings in force).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

PREFIX = "NKI_AUTOTUNE_"
KERNELS = "NKI_AUTOTUNE_KERNELS"
KERNEL_OP = "NKI_AUTOTUNE_KERNEL_"
TABLE = "NKI_AUTOTUNE_TABLE"
STRICT = "NKI_AUTOTUNE_STRICT"
RECORD = "NKI_AUTOTUNE_RECORD"
RECORD_SAMPLES = "NKI_AUTOTUNE_RECORD_SAMPLES"
LOG = "NKI_AUTOTUNE_LOG"

MODES = ("auto", "off", "on")
_OFF = {"off", "0", "false", "no"}
_ON = {"on", "1", "true", "yes"}
_IMPL_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


class SettingsError(ValueError):
    """An environment variable holds a value that is not allowed."""


@dataclass(frozen=True)
class Settings:
    kernels: str = "auto"
    """``NKI_AUTOTUNE_KERNELS``: auto | off | on, for every op."""
    per_op: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """``NKI_AUTOTUNE_KERNEL_<OP>``: op name -> auto | off | on | an impl name."""
    tables: tuple[str, ...] = ()
    """``NKI_AUTOTUNE_TABLE``: dispatch tables, first match wins (like PATH)."""
    strict: bool = False
    """``NKI_AUTOTUNE_STRICT``: a foreign fingerprint is an error, not a warning."""
    record: str | None = None
    """``NKI_AUTOTUNE_RECORD``: write a profile of this run here at exit."""
    cache_dir: str = ""
    """Where tuning studies live by default: ``$XDG_CACHE_HOME/nki-autotune`` (else ``~/.cache/nki-autotune``)."""
    record_samples: bool = False
    """``NKI_AUTOTUNE_RECORD_SAMPLES``: also save the real inputs of data-dependent ops (indices)."""
    log: bool = False
    """``NKI_AUTOTUNE_LOG``: log each distinct dispatch decision once (logger ``nki_autotune.dispatch``)."""

    def ident(self) -> tuple:
        """Hashable identity of the switches that steer dispatch."""
        return self.kernels, tuple(sorted(self.per_op.items())), self.tables, self.strict

    def switch(self, op: str) -> tuple[str, str]:
        """The switch value that governs ``op`` and the variable it came from."""
        if op in self.per_op:
            return self.per_op[op], KERNEL_OP + op.upper()
        return self.kernels, KERNELS


def _mode(var: str, raw: str, allow_impl: bool) -> str:
    value = raw.strip().lower()
    if value in _OFF:
        return "off"
    if value in _ON:
        return "on"
    if value == "auto":
        return "auto"
    if allow_impl and _IMPL_NAME.match(value):
        return value
    allowed = "auto, off, on (or 0/false/no, 1/true/yes)"
    if allow_impl:
        allowed += ", or an impl name of the op"
    raise SettingsError(f"{var}={raw!r} is not allowed; use one of: {allowed}")


def _flag(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise SettingsError(f"{var}={raw!r} is not allowed; use 1 (or true, yes, on) or 0 (or false, no, off)")


VARIABLES = (KERNELS, TABLE, STRICT, RECORD, RECORD_SAMPLES, LOG)
"""Every variable of docs/design.md §4 but the per-op ``NKI_AUTOTUNE_KERNEL_<OP>``."""


def read_settings(env: Mapping[str, str]) -> Settings:
    """Parse the switches from ``env``; every bad value names its variable, and so does a misspelt name (which
    would otherwise leave its switch at the default unnoticed)."""
    for var in env:
        if var.startswith(PREFIX) and var not in VARIABLES and not var.startswith(KERNEL_OP):
            raise SettingsError(f"{var} is not a variable of nki-autotune; it reads {', '.join(VARIABLES)} and "
                                f"{KERNEL_OP}<OP>")
    kernels = _mode(KERNELS, env[KERNELS], allow_impl=False) if env.get(KERNELS) else "auto"
    per_op = {}
    for var, raw in env.items():
        if var.startswith(KERNEL_OP) and var != KERNELS:
            op = var[len(KERNEL_OP):].lower()
            if not op:
                raise SettingsError(f"{var} names no op; use {KERNEL_OP}<OP>, e.g. {KERNEL_OP}RMSNORM")
            per_op[op] = _mode(var, raw, allow_impl=True)
    tables = tuple(p for p in env.get(TABLE, "").split(os.pathsep) if p.strip())
    record = env.get(RECORD) or None
    return Settings(
        kernels=kernels,
        per_op=MappingProxyType(per_op),
        tables=tables,
        strict=_flag(STRICT, env.get(STRICT, "")),
        record=record,
        record_samples=_flag(RECORD_SAMPLES, env.get(RECORD_SAMPLES, "")),
        log=_flag(LOG, env.get(LOG, "")),
        cache_dir=user_cache_dir(env),
    )


def user_cache_dir(env: Mapping[str, str]) -> str:
    """``$XDG_CACHE_HOME/nki-autotune``, else ``~/.cache/nki-autotune``. The folder is the process's, not a switch:
    ``env`` without ``XDG_CACHE_HOME`` (``scope()``'s switches alone) takes the process environment's."""
    base = env.get("XDG_CACHE_HOME") or os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "nki-autotune")


def switch_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``NKI_AUTOTUNE_*`` variable that is set, for ``nki-autotune list``."""
    env = os.environ if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith(PREFIX)}
