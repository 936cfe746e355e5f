"""``python -m tools.p2r_study``: the same as ``p2r-study``."""

import sys

from tools.p2r_study.cli import main

if __name__ == "__main__":
    sys.exit(main())
