"""`python -m thunderctl.daemon STATE_DIR`: run a cluster's daemon in the foreground (what `up` starts)."""

import sys
from pathlib import Path

from thunderctl.daemon.service import main

if len(sys.argv) != 2:
    sys.exit("usage: python -m thunderctl.daemon STATE_DIR")
main(Path(sys.argv[1]))
