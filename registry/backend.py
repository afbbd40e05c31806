"""The Backend protocol and the table of backends by name."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, Protocol


def dist_version(dist: str) -> str:
    """The installed version of a distribution, or "absent" (fingerprints and reports list them)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class Backend(Protocol):
    """Where kernels run and what they are measured against."""

    name: str
    device: str
    """The torch device type of the tensors this backend's kernels take."""
    compiler: str

    def why_unavailable(self) -> str | None:
        """None when usable here, else the reason (for people)."""

    def available(self) -> bool: ...

    def synchronize(self) -> None:
        """Wait for queued work, before the clock is read."""

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The compiler baseline: one static, graph-break-free region."""

    def fingerprint(self) -> dict[str, Any]:
        """What changes compiled code or timings: a table from elsewhere does not apply."""

    def custom_op(self, name: str, fn: Callable[..., Any], schema: str, overload: str = "default") -> Any:
        """Register ``fn`` as the operator ``name`` (overload ``overload``, where the backend names overloads)
        with ``schema``; returns an object with ``register_fake`` and ``register_autograd`` (a
        ``torch.library.custom_op``)."""


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(sorted(_BACKENDS))}") from None


def backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def default_backend() -> Backend:
    """The first available backend, accelerators first."""
    for name in ("neuron", "cpu"):
        b = _BACKENDS.get(name)
        if b is not None and b.available():
            return b
    raise RuntimeError("no backend is available")
