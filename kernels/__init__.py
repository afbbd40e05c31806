"""nki_autotune.kernels: the kernel pack. Importing it registers every op.

Each function matches its PyTorch expression; where no kernel is enabled (or a
kernel declines the input) the call runs that expression, so the compiler fuses
it like any other code.
"""

from ..registry.switches import check_switches, current
from .cross_entropy import cross_entropy
from .embedding import embedding
from .rmsnorm import rmsnorm
from .rope import rope
from .segment_sum import segment_sum
from .softmax import softmax
from .swiglu import swiglu

# Switch names and tables are checked now, in eager mode, before any compiled call.
check_switches()
current()

__all__ = ["cross_entropy", "embedding", "rmsnorm", "rope", "segment_sum", "softmax", "swiglu"]
