"""nki_autotune.kernels: the kernel pack. Importing it registers every op.

Each function matches its PyTorch expression; where no kernel is enabled (or a
kernel declines the input) the call runs that expression, so the compiler fuses
it like any other code.
"""

from ..registry import check_switches, load_tables
from .rmsnorm import rmsnorm

# Switch names and tables are checked now, in eager mode, before any compiled call.
check_switches()
load_tables()

__all__ = ["rmsnorm"]
