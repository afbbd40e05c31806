"""The ``nki-autotune`` command: run, show, diff, list, record, check, verify, selftest; one module per command.

Exit codes: 0 success, 1 the work failed, 2 bad usage or bad input.

``show`` and ``diff`` read tables as plain data and never import torch or the kernels; the other commands
import them when they start (``common.heavy``), after their own checks of the environment.
"""

from __future__ import annotations

import argparse
import signal
import sys

from ...registry import FormatError, SettingsError
from ...registry.backend import dist_version
from . import check, listing, record, run, selftest, tables, verify
from .common import Interrupted, UsageError, console

__all__ = ["Interrupted", "UsageError", "main", "parser"]

COMMANDS = (run, tables, listing, record, check, verify, selftest)
"""In the order ``--help`` lists them."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nki-autotune",
        description="Benchmark kernels against the compiler at every call site of a model "
                    "and write the dispatch table that enables each kernel only where it wins.",
    )
    p.add_argument("--version", action="version", version=f"nki-autotune {dist_version('nki-autotune')}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "fn", None) is None:
        p.print_help()
        return 2
    out = console()

    def err(msg: str) -> None:
        print(f"nki-autotune {args.cmd}: {msg}", file=sys.stderr)
    try:
        return args.fn(args, out)
    except (UsageError, FormatError, SettingsError) as e:
        err(f"error: {e}")
        return 2
    except KeyboardInterrupt as e:
        err("interrupted" + ("; finished trials are kept in storage, and the table is written only once every key "
                             "is complete: run the same command again to resume" if args.cmd == "run" else ""))
        return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
    except Exception as e:
        err(f"failed: {type(e).__name__}: {e}")
        return 1
