"""A loopback HTTP server run as a child process, waited for by its /health, stopped by pid (for tests and benchmarks)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx

from thunderctl.processes import pick_free_port, poll_until


class ChildServer:
    """`command_for(port)` on a free port of 127.0.0.1, its output in `log_path`."""

    what = "server"  # how errors name it

    def __init__(
        self, command_for: Callable[[int], list[str]], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = pick_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command_for(self.port), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_healthy(self, timeout: float = 60.0) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:

            def healthy() -> bool:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.what} exited {self.process.returncode}:\n{self.log_path.read_text()}")
                try:
                    return client.get(f"{self.url}/health").status_code == 200
                except httpx.TransportError:
                    return False

            if not poll_until(healthy, timeout, 0.05):
                raise RuntimeError(f"{self.what} not healthy after {timeout:.0f} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
