"""A NumPy interpreter of the NKI 0.7 subset the pack uses (the standalone ``nki`` package's API).

It runs NKI kernels on the CPU for numerics: documented semantics, bfloat16 through ml_dtypes, new allocations
filled with NaN (integers with 4) as the real simulator does, compiled loops with run-time scalars, and the hardware
limits of the target (``..limits``; NEURON_PLATFORM_TARGET_OVERRIDE, else the detected one, else trn3) enforced
with errors that name the call and the rule. Its timings mean nothing. Import it through
``nki_autotune.kernels.nki``, which prefers the real ``nki`` where a release the kernels target is installed.
"""

from ..limits import TARGETS
from . import isa, language
from .errors import NkiError, NkiRangeWarning
from .jit import Kernel, jit, simulate
from .scalar import NkiScalar, NkiTypeError, VirtualRegister
from .tensor import NkiTensor

__version__ = "0.7.0"
"""The NKI release whose semantics the interpreter follows."""

__all__ = ["Kernel", "NkiError", "NkiRangeWarning", "NkiScalar", "NkiTensor", "NkiTypeError", "TARGETS",
           "VirtualRegister", "isa", "jit", "language", "simulate"]
