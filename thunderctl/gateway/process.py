"""`thunderctl serve` as a subprocess, for benchmarks and tests that need a real gateway."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from thunderctl.gateway.auth import API_KEY_ENV, env_api_key
from thunderctl.jsonapi import bearer_headers
from thunderctl.processes import pick_free_port, poll_until


class ServeProcess:
    """A gateway in its own process (so it does not share the caller's GIL), stopped by pid."""

    def __init__(
        self, backends: Sequence[str], options: Sequence[str], log_path: Path, api_key: str | None = None
    ) -> None:
        """`api_key` defaults to $THUNDERCTL_API_KEY, which the gateway would read anyway."""
        self.port = pick_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = api_key or env_api_key()
        command = [sys.executable, "-m", "thunderctl", "serve", "--port", str(self.port)]
        for backend in backends:
            command += ["--backend", backend]
        # The key goes in the environment, out of the command line that `ps` shows.
        env = {**os.environ, API_KEY_ENV: self.api_key} if self.api_key else dict(os.environ)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, *options], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this gateway sends."""
        return bearer_headers(self.api_key)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:

            def healthy() -> bool:
                if self.process.poll() is not None:
                    raise RuntimeError(f"gateway exited {self.process.returncode}:\n{self.log_path.read_text()}")
                try:
                    return client.get(f"{self.url}/health").status_code == 200
                except httpx.TransportError:
                    return False

            if not poll_until(healthy, timeout, 0.2):
                raise RuntimeError(f"gateway not healthy after {timeout:.0f} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
