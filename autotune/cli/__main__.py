"""``python -m nki_autotune.autotune.cli``."""

import sys

from . import main

sys.exit(main())
