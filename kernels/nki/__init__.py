"""The one place for "NKI here": ``from nki_autotune.kernels.nki import nki, nl, nisa``.

The real ``nki``, ``nki.language`` and ``nki.isa`` where an ``nki`` of the release the kernels are written for
(``TARGETED``: 0.7, Neuron 2.33) is installed; otherwise the project's interpreter (``.interp``), which runs the
same kernel code on the CPU. An older real ``nki`` is refused, with the reason in ``WHY_NOT_REAL``: the kernels
use 0.7's semantics (tracing specialization, ``nl.fori_loop`` with NkiScalar indices, the LNC degree checked by
the compiler), so they would not specialize on it. The per-target limits live in ``.limits``, the helpers the
kernels share in ``.tiles``, and launching (on device through TorchNeuron, or simulated) in ``.launch``.
"""

from __future__ import annotations

from ...registry.neuron import NKI_TARGETED, nki_problem

TARGETED = ".".join(map(str, NKI_TARGETED))
WHY_NOT_REAL = nki_problem()
"""None where the real nki is used; else why the interpreter stands in (for people)."""

if WHY_NOT_REAL is None:
    import nki  # type: ignore[import-not-found]
    import nki.isa as nisa  # type: ignore[import-not-found]
    import nki.language as nl  # type: ignore[import-not-found]

    REAL = True
else:
    from . import interp as nki
    from .interp import isa as nisa
    from .interp import language as nl

    REAL = False

__all__ = ["REAL", "TARGETED", "WHY_NOT_REAL", "nisa", "nki", "nl"]
