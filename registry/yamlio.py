"""YAML files of the project: atomic writes, and load errors that name the place."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


class FormatError(ValueError):
    """A file does not follow its format; the message names file, entry and field."""


class Flow(list):
    """A list written on one line, as in the examples of docs/design.md §5."""


class FlowDict(dict):
    """A mapping written on one line."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
_Dumper.add_representer(FlowDict, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
_Dumper.add_representer(tuple, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it, for every thread meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file beside ``path``, then rename: readers never see half a file. The file gets the
    mode a plain ``open`` would give it (the one it had, else 0666 less the umask), not the temporary file's 0600:
    a table on shared storage stays readable by the jobs of other users."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def unwritable(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot become a file (``atomic_write_text`` makes its missing folders), or None: asked before
    the work whose result it will hold, not after."""
    p = Path(path)
    if p.is_dir():
        return "is a directory; name a file"
    parent = next((q for q in p.resolve().parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"cannot be written: {parent} is a file, not a folder"
    return None


def load(path: str | os.PathLike, what: str) -> Any:
    """Parse a YAML file; an unreadable or malformed file is a FormatError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise FormatError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: cannot read {what}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise FormatError(f"{path}: not valid YAML{where}: {problem}") from None


def _names(types: Any) -> str:
    types = types if isinstance(types, tuple) else getattr(types, "__args__", (types,))
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "list": "a list",
                        "dict": "a mapping", "bool": "true/false", "NoneType": "null"}.get(t.__name__, t.__name__)
                        for t in types)


class Fields:
    """Typed access to one mapping of a file, with errors that say where."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise FormatError(f"{where}: expected a mapping, got {type(data).__name__}")
        self.data, self.where = data, where

    def fail(self, field: str, msg: str) -> FormatError:
        return FormatError(f"{self.where}: field '{field}': {msg}")

    def get(self, field: str, types: type | tuple[type, ...], default: Any = ..., what: str = "") -> Any:
        if field not in self.data or self.data[field] is None:
            if default is ...:
                raise self.fail(field, "missing" if field not in self.data else
                                f"empty (null); expected {what or _names(types)}")
            return default
        value = self.data[field]
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.fail(field, f"expected {what or _names(types)}, got {value!r}")
        if not isinstance(value, types):
            raise self.fail(field, f"expected {what or _names(types)}, got {value!r}")
        return value

    def unknown(self, allowed: tuple[str, ...]) -> None:
        extra = sorted(set(self.data) - set(allowed))
        if extra:
            raise self.fail(extra[0], f"unknown field; allowed: {', '.join(allowed)}")

    def shape(self, value: Any, field: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in value):
            raise self.fail(field, f"a shape must be a list of non-negative integers, got {value!r}")
        return tuple(value)

    def dtype(self, value: Any, field: str, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise self.fail(field, f"unknown dtype {value!r}; allowed: {', '.join(allowed)}")
        return value

    def attrs(self, field: str, types: dict[str, type], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """The op's attributes, each present (or defaulted) and of its type (ints are accepted for floats)."""
        raw = self.get(field, dict, default={})
        extra = sorted(set(raw) - set(types))
        if extra:
            raise self.fail(f"{field}.{extra[0]}", f"not an attribute of this op; it has: {', '.join(types) or 'none'}")
        out = {}
        for name, t in types.items():
            if name not in raw and name not in (defaults or {}):
                raise self.fail(f"{field}.{name}", "missing")
            v = raw[name] if name in raw else defaults[name]
            number = t is float or t == float | None  # a float, or an optional one
            if number and isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    pass
            ok = isinstance(v, t) and not (isinstance(v, bool) and t is not bool)
            if number and isinstance(v, int) and not isinstance(v, bool):
                v, ok = float(v), True
            if not ok:
                raise self.fail(f"{field}.{name}", f"expected {_names(t)}, got {v!r}")
            out[name] = v
        return out
