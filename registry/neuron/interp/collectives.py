"""``nki.collectives`` of the interpreter: importable (NKI Library modules import ``ReplicaGroup`` at module level),
but collectives across devices are not interpreted: using one is an error that says so."""

from __future__ import annotations

from .errors import NkiError


class _NotInterpreted:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NkiError(f"nki.collectives.{self.name}: collectives across devices are not interpreted; the interpreter "
                       "runs the programs of one LNC launch (nki.lnc)")

    def __repr__(self) -> str:
        return f"nki.collectives.{self.name} (not interpreted)"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _NotInterpreted(name)
