"""A local vLLM-CPU engine and `thunderctl serve` in front of it, for the benchmark scripts.

Both are subprocesses stopped by their pids when the `local_stack` block ends, whatever happens.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console

from thunderctl.engines.local import (
    EngineHome,
    LocalEngine,
    LocalEngineConfig,
    pick_free_port,
)

# Two cores shared with other jobs: start-up took 35-60 s idle, over 3 minutes under load.
ENGINE_START_TIMEOUT_S = 600.0


class GatewayProcess:
    """`thunderctl serve` in a subprocess; stopped by its pid."""

    def __init__(self, engine_url: str, extra_args: list[str], log_path: Path) -> None:
        self.port = pick_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "thunderctl", "serve", "--backend", engine_url, "--port", str(self.port)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.process = subprocess.Popen([*command, *extra_args], stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log_path.read_text()}")
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


@dataclass(frozen=True)
class EngineSettings:
    kv_blocks: int = 256
    block_size: int = 128
    max_model_len: int = 16384


def start_engine(settings: EngineSettings, log_dir: Path, console: Console) -> LocalEngine:
    home = EngineHome.default()
    if not home.is_installed():
        raise SystemExit(f"no local engine in {home.root}: run ./install.sh first")
    engine_config = LocalEngineConfig(
        port=pick_free_port(),
        num_gpu_blocks=settings.kv_blocks,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
    )
    engine = LocalEngine.start(home, engine_config, log_dir / f"vllm-{engine_config.port}.log")
    with console.status(f"starting vLLM-CPU ({engine_config.kv_capacity_tokens} KV tokens) on {engine.url}"):
        try:
            engine.wait_healthy(timeout=ENGINE_START_TIMEOUT_S)
        except BaseException:
            engine.stop()
            raise
    return engine


@contextlib.contextmanager
def local_stack(
    settings: EngineSettings, engine_url: str | None, gateway_args: list[str], log_dir: Path, console: Console
) -> Iterator[tuple[str, str]]:
    """(engine URL, gateway URL): a new engine unless `engine_url` names a running one."""
    engine = None if engine_url else start_engine(settings, log_dir, console)
    url = engine_url or engine.url  # type: ignore[union-attr]
    gateway = GatewayProcess(url, gateway_args, log_dir / "gateway.log")
    try:
        gateway.wait_healthy()
        console.print(f"engine {url}, gateway {gateway.url} {' '.join(gateway_args)}")
        yield url, gateway.url
    finally:
        gateway.stop()
        if engine is not None:
            engine.stop()
