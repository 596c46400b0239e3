"""`thunderctl engine sim` as a subprocess, for tests and benchmarks that need simulated workers."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from thunderctl.engines.child import ChildServer

# The module `up` starts workers with: it skips importing the whole command line.
SIM_MODULE = "thunderctl.engines.simulated.cli"


def sim_command(python: str, port: int, host: str, options: Sequence[str] = ()) -> list[str]:
    return [python, "-m", SIM_MODULE, "--port", str(port), "--host", host, *options]


class SimProcess(ChildServer):
    """One simulated worker in its own process, on a free loopback port; stopped by pid."""

    what = "sim engine"

    def __init__(self, options: Sequence[str], log_path: Path) -> None:
        super().__init__(lambda port: sim_command(sys.executable, port, "127.0.0.1", options), log_path)
