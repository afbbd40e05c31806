"""A NumPy interpreter of NKI 0.8 (the standalone ``nki`` package's API) as far as the pack and the NKI Library use it.

It runs NKI kernels on the CPU for numerics: documented semantics, bfloat16 through ml_dtypes, new allocations
filled with NaN (integers with 4) as the real simulator does, compiled loops with run-time scalars, the programs of
an LNC launch at once (so ``nki.lnc`` exchanges meet), and the hardware limits of the target (``..limits``;
NEURON_PLATFORM_TARGET_OVERRIDE, else the detected one, else trn3) enforced with errors that name the call and the
rule. Its timings mean nothing. Import it through ``nki_autotune.registry.neuron.nki``, which prefers the real
``nki`` where a release the kernels target is installed; ``nki_autotune.registry.neuron.nki.install()`` puts it in
``sys.modules`` as ``nki`` (``nki.language``, ``nki.isa``, ``nki.isa.constants``, ``nki.lnc``, ``nki.typing``,
``nki.collectives``) where none is, so code written against ``import nki`` runs unchanged.

NKI 0.8 docs cited (Neuron 2.34): ``ANN08`` = about-neuron/announcements/neuron2.x/
announce-intent-eos-nki-virtualregister-lnc-apis.rst (the deprecations, which point to the 2.34.0 NKI release notes
and "Migrating from NKI 0.7.0 to NKI 0.8.0"), ``ANN_GRID`` = .../announce-intent-eos-nki-spmd-launch-grid.rst (no
grid needed; a grid other than the LNC in use is a compile-time error), ``EVRF066`` = compiler/error-codes/
EVRF066.rst, ``LNC`` = nki/api/nki.lnc.rst and its generated pages (sendrecv, sendrecv_compute, core_barrier).
"""

from ..limits import TARGETS
from . import collectives, constants, isa, language, lnc
from . import nki_typing as typing
from .errors import NkiError, NkiRangeWarning
from .jit import Kernel, jit, simulate
from .scalar import NkiScalar, NkiTypeError, VirtualRegister
from .tensor import NkiTensor

INTERPRETER = True
"""Marks the interpreter (``registry.neuron.nki_version`` tells it from a real nki installed under the same name)."""

__version__ = "0.8.0"
"""The NKI release whose semantics the interpreter follows."""

dtype = str
"""The type of a dtype (``nki.dtype``): dtypes are their names here."""

MODULES = {"nki.language": language, "nki.isa": isa, "nki.isa.constants": constants, "nki.lnc": lnc,
           "nki.typing": typing, "nki.collectives": collectives}
"""The submodules of ``nki`` the interpreter provides, by the name they are imported as."""

__all__ = ["INTERPRETER", "MODULES", "Kernel", "NkiError", "NkiRangeWarning", "NkiScalar", "NkiTensor",
           "NkiTypeError", "TARGETS", "VirtualRegister", "collectives", "constants", "dtype", "isa", "jit", "language",
           "lnc", "simulate", "typing"]
