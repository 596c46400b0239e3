"""`python -m thunderctl.daemon STATE_DIR FD`: run a cluster's daemon in the foreground, serving the
gateway on the listening socket it inherits as file descriptor FD (what its supervisor starts)."""

import sys
from pathlib import Path

from thunderctl.daemon.service import main

if len(sys.argv) != 3 or not sys.argv[2].isdigit():
    sys.exit("usage: python -m thunderctl.daemon STATE_DIR FD (FD: the gateway's bound, listening socket)")
main(Path(sys.argv[1]), int(sys.argv[2]))
