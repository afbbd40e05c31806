"""The ``nki-autotune`` command."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


def _version() -> str:
    try:
        return importlib.metadata.version("nki-autotune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nki-autotune",
        description="Benchmark kernels against the compiler at every call site of a model "
                    "and write the dispatch table that enables each kernel only where it wins.",
    )
    p.add_argument("--version", action="version", version=f"nki-autotune {_version()}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    del args
    parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
