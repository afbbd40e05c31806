"""``python -m nki_autotune.autotune.cli``."""

import sys

from . import main

if __name__ == "__main__":  # importing the module (as a wheel's check of every module does) runs nothing
    sys.exit(main())
