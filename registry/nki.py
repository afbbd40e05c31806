"""The one import point for NKI: ``from nki_autotune.registry.nki import nki, nl, nisa``.

The real ``nki``, ``nki.language`` and ``nki.isa`` where the nki package is installed;
otherwise the project's interpreter, which runs the same kernel code on the CPU.
"""

from __future__ import annotations

try:
    import nki  # type: ignore[import-not-found]
    import nki.isa as nisa  # type: ignore[import-not-found]
    import nki.language as nl  # type: ignore[import-not-found]

    REAL = True
except ImportError:
    from . import nkisim as nki
    from .nkisim import isa as nisa
    from .nkisim import language as nl

    REAL = False

__all__ = ["REAL", "nki", "nisa", "nl"]
