"""`thunderctl serve` as a subprocess, for benchmarks and tests that need a real gateway."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from thunderctl.engines.local import pick_free_port


class ServeProcess:
    """A gateway in its own process (so it does not share the caller's GIL), stopped by pid."""

    def __init__(self, backends: Sequence[str], options: Sequence[str], log_path: Path) -> None:
        self.port = pick_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "thunderctl", "serve", "--port", str(self.port)]
        for backend in backends:
            command += ["--backend", backend]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, *options], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"gateway exited {self.process.returncode}:\n{self.log_path.read_text()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"gateway not healthy after {timeout:.0f} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
