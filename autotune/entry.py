"""The console script. The registry reads the switches when it is imported, so a bad
``NKI_AUTOTUNE_*`` value surfaces during the import of the CLI: report it as bad input."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from . import cli  # imports the registry, which reads and checks the switches
    except ValueError as e:
        print(f"nki-autotune: error: {e}", file=sys.stderr)
        return 2
    return cli.main()
