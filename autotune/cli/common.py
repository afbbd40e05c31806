"""What the commands share: their errors, the checks made before any work, the argparse types, the console."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys
from collections.abc import Callable

from rich.console import Console

from ...registry.env import RECORD, read_settings
from ...registry.yamlio import unwritable


class UsageError(Exception):
    """Bad usage or bad input: exit code 2."""


class Interrupted(KeyboardInterrupt):
    """Stopped by a signal (Ctrl-C's SIGINT, or SIGTERM from a scheduler): exit code 128 + its number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def writable(path: str, option: str) -> None:
    """Refuse an output path that cannot be a file before any work is done."""
    why = unwritable(path)
    if why is not None:
        raise UsageError(f"{option} {path} {why}")


def heavy(imports: list[str] | None = None):
    """The registry's torch side with the kernel pack registered, then the user's modules (``--import``)."""
    import nki_autotune.kernels  # noqa: F401  (registers every op of the pack)

    from ... import registry

    for name in imports or ():
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UsageError(f"--import {name}: cannot import it: {e}") from None
    registry.check_switches()
    return registry


def not_recording(what: str) -> None:
    recording = read_settings(os.environ).record
    if recording:
        raise UsageError(f"{RECORD} is set ({recording}): it records this process and runs compiled regions "
                         f"eagerly, so nothing would be measured compiled; unset it to {what}")


def at_least(lo: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` no smaller than ``lo`` (a bad one exits 2, naming the option)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {text}")
        return value

    return parse


def positive(text: str) -> float:
    """An argparse type: a number above 0."""
    value = at_least(0.0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def add_imports(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (repeatable): it registers its own ops and impls")


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


UNWRAPPED = 10_000
"""The width of output that is not a terminal: no table is that wide, so none folds a cell."""


def console() -> Console:
    """A terminal's width where stdout is a terminal. Elsewhere (logs, CI, a pipe) nothing is wrapped: messages and
    paths stay whole on their lines, and tables take the width they need, whether or not the environment asks for
    colours (``FORCE_COLOR``, ``TTY_COMPATIBLE``, which make rich take a pipe for an 80-column terminal)."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        tty = False
    return Console(highlight=False) if tty else Console(highlight=False, width=UNWRAPPED, soft_wrap=True)

