"""`python -m stagereplay`: the command line of ``stagereplay.cli``."""

import sys

from stagereplay.cli import main

if __name__ == "__main__":
    sys.exit(main())
