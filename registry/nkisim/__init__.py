"""A NumPy interpreter of the NKI subset the pack uses (the standalone ``nki`` package's API).

It runs NKI kernels on the CPU for numerics: documented semantics, bfloat16 through
ml_dtypes, new allocations filled with NaN (integers with 4) as the real simulator
does, and the hardware limits of the target named by NEURON_PLATFORM_TARGET_OVERRIDE
(trn2, trn3; unset means trn3) enforced with errors that name the call. Its timings
mean nothing. Import it through ``nki_autotune.registry.nki``, which prefers the
real ``nki`` package where it is installed.
"""

from . import isa, language
from .jit import Kernel, jit, simulate
from .state import TARGETS, NkiError
from .tensor import NkiTensor

__all__ = ["Kernel", "NkiError", "NkiTensor", "TARGETS", "isa", "jit", "language", "simulate"]
