import sys

from stagereplay.cli import main

sys.exit(main())
