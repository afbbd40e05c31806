"""The one place for "NKI here": ``from nki_autotune.registry.neuron.nki import nki, nl, nisa``.

The real ``nki``, ``nki.language`` and ``nki.isa`` where an ``nki`` of a release the kernels run on is installed
(``registry.neuron.NKI_RANGE``: 0.7 to 0.8, Neuron 2.33-2.34; ``TARGETED``: 0.8, the release kernels and interpreter
follow); otherwise the project's interpreter (``.interp``), which runs the same kernel code on the CPU. Another real
``nki`` is refused, with the reason in ``WHY_NOT_REAL``: older ones specialize differently (0.7 brought tracing
specialization, ``nl.fori_loop`` with NkiScalar indices, the LNC degree checked by the compiler), newer ones are
untried. ``neuronxcc.nki`` (removed from the compiler in Neuron 2.34) is never imported. The per-target limits live
in ``.limits``, the helpers the kernels share in ``.tiles``, and launching (on device through TorchNeuron, or
simulated) in ``.launch``.

``install()`` puts the interpreter in ``sys.modules`` as ``nki`` where no real one imports, so code written against
``import nki`` (AWS's NKI Library, unchanged) runs through it.
"""

from __future__ import annotations

import sys
from types import ModuleType

from . import NKI_TARGETED, nki_problem

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


def install() -> ModuleType:
    """``nki`` for code that imports it: the real one where it is used here; else the interpreter, put in
    ``sys.modules`` as ``nki`` and its submodules (``nki.language``, ``nki.isa``, ``nki.isa.constants``, ``nki.lnc``,
    ``nki.typing``, ``nki.collectives``). Idempotent. Where a real ``nki`` of another release imports, it is left
    in place and this raises, with the reason: the interpreter never shadows an installed nki."""
    if REAL:
        return nki
    present = sys.modules.get("nki")
    if present is not None and present is not nki:
        raise RuntimeError(f"an nki module is already imported and is not the interpreter ({WHY_NOT_REAL}); "
                           "nki_autotune.registry.neuron.nki.install() does not replace it")
    if present is None and not WHY_NOT_REAL.startswith(("nki cannot be imported", "nki is the project's")):
        raise RuntimeError(f"{WHY_NOT_REAL}; nki_autotune.registry.neuron.nki.install() "
                           "does not shadow an installed nki")
    sys.modules["nki"] = nki
    sys.modules.update(nki.MODULES)
    return nki


__all__ = ["REAL", "TARGETED", "WHY_NOT_REAL", "install", "nisa", "nki", "nl"]
