"""`thunderctl engine sim` as a subprocess, for tests and benchmarks that need simulated workers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from thunderctl.engines.local import pick_free_port

# The module `up` starts workers with: it skips importing the whole command line.
SIM_MODULE = "thunderctl.engines.sim_cli"


def sim_command(python: str, port: int, host: str, options: Sequence[str] = ()) -> list[str]:
    return [python, "-m", SIM_MODULE, "--port", str(port), "--host", host, *options]


class SimProcess:
    """One simulated worker in its own process, on a free loopback port; stopped by pid."""

    def __init__(self, options: Sequence[str], log_path: Path) -> None:
        self.port = pick_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(sim_command(sys.executable, self.port, "127.0.0.1", options),
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"sim engine exited {self.process.returncode}:\n{self.log_path.read_text()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"sim engine not healthy after {timeout:.0f} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
