"""Source hashes of kernels, computed from the files alone (no import, no torch).

An impl's source is its module and every module of the same package family that it imports, transitively
(a kernel's shared helpers, its op's reference), the modules of its backend's runtime it imports (``RUNTIMES``),
and the modules it imports of the packages it names in ``SOURCE_FAMILIES`` (the library kernels it wraps): a
change to any of them retunes the kernel. Reading imports
from the syntax tree rather than from loaded modules lets ``nki-autotune show`` tell a stale table entry
without importing torch, numba or the kernels themselves.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from functools import cache
from pathlib import Path

RUNTIMES = ("nki_autotune.registry.cpu", "nki_autotune.registry.neuron.launch", "nki_autotune.registry.neuron.limits")
"""The backends' parts a kernel runs on: the CPU runtime (compilation, views, the output pool, threads), the NKI
launch and the per-target limits. The NKI interpreter is not among them: it stands in for ``nki`` on the CPU, for
numerics, and a change to it changes no kernel on a device."""


@cache
def module_file(name: str) -> Path | None:
    """The file of module ``name``, found without running any package's code (None if not found)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        f = getattr(loaded, "__file__", None)
        return Path(f) if f and f.endswith(".py") else None
    parts = name.split(".")
    try:
        spec, i = importlib.util.find_spec(parts[0]), 1
        # find_spec of a dotted name imports its parent: descend only while the parent runs no code
        while spec is not None and i < len(parts) and (spec.origin is None or ".".join(parts[:i]) in sys.modules):
            spec, i = importlib.util.find_spec(".".join(parts[:i + 1])), i + 1
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if i == len(parts):
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for base in spec.submodule_search_locations or ():  # the rest of the name is folders on disk
        path = Path(base, *parts[i:])
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def family(module: str) -> str:
    """The package family whose modules count as a kernel's source: ``a.b`` of ``a.b.c.d``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def declared_families(path: Path) -> tuple[str, ...]:
    """The package families a module's ``SOURCE_FAMILIES = ("pkg", ...)`` names: a module wrapping another
    package's kernels (``kernels/nkilib``: AWS's NKI Library) counts the modules of those packages it imports as its
    source too, so a new release of them retunes it."""
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SOURCE_FAMILIES"
                                                for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


@cache
def _imports(module: str, path: Path) -> frozenset[str]:
    """Absolute names of the modules ``module``'s file imports (relative imports resolved)."""
    tree = _tree(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            out.add(root)
            out.update(f"{root}.{a.name}" for a in node.names)  # `from . import helpers` names a module
    return frozenset(out)


def source_modules(module: str) -> list[str]:
    """``module`` and the modules of its family, of ``RUNTIMES`` and of the families it declares
    (``declared_families``) it imports, transitively, sorted. A module of a declared family that cannot be found
    here is left out."""
    root = module_file(module)
    fams = (family(module), *RUNTIMES, *(declared_families(root) if root is not None else ()))
    seen: set[str] = set()
    stack = [module]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None or path.name == "__init__.py" and name != module:
            continue  # names that are not modules, and package inits (they only re-export)
        seen.add(name)
        stack.extend(m for m in _imports(name, path)
                     if any(m == f or m.startswith(f + ".") for f in fams) and m not in seen)
    return sorted(seen)


@cache
def source_hash(module: str) -> str | None:
    """Hash of ``module``'s source (see ``source_modules``) as this process found it; None when its file cannot be
    found."""
    names = source_modules(module)
    if not names:
        return None
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + module_file(name).read_bytes())
    return h.hexdigest()[:16]
