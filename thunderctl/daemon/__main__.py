"""`python -m thunderctl.daemon STATE_DIR FD [--relays N]`: run a cluster's daemon in the foreground,
serving the gateway on the listening socket it inherits as file descriptor FD (what its supervisor
starts), or, with N ≥ 2 relay processes on that socket, only their scheduler."""

import argparse
from pathlib import Path

from thunderctl.daemon.service import main

parser = argparse.ArgumentParser(prog="python -m thunderctl.daemon")
parser.add_argument("state_dir", type=Path)
parser.add_argument("fd", type=int, help="the gateway's bound, listening socket")
parser.add_argument("--relays", type=int, default=1, help="relay processes that accept on it (1: none)")
args = parser.parse_args()
main(args.state_dir, args.fd, args.relays)
