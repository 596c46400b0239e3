"""`thunderctl engine sim`: its options, and running the simulated worker in the foreground."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from thunderctl import aio
from thunderctl.engines.simulated.server import DEFAULT_PRESET, SimConfigError, SimEngineConfig, SimServer
from thunderctl.sim.presets import preset_names
from thunderctl.terminal import fail


def engine_sim(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    preset: Annotated[str, typer.Option(help=f"The worker simulated: {', '.join(preset_names())}.")] = DEFAULT_PRESET,
    kv_blocks: Annotated[int | None, typer.Option(min=1, help="KV cache blocks (default: the preset's).")] = None,
    block_size: Annotated[int | None, typer.Option(min=1, help="Tokens per KV block (default: the preset's).")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(min=2, help="Longest prompt + answer (default: the preset's).")
    ] = None,
    served_model_name: Annotated[str, typer.Option(help="The model name clients send.")] = "tiny",
    time_scale: Annotated[
        float, typer.Option(min=0, help="Wall seconds per simulated second of engine time (0: as fast as it can).")
    ] = 1.0,
) -> None:
    """Serve a simulated vLLM worker (the simulator's engine model) over vLLM's OpenAI API, in real time."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = SimEngineConfig(
        port=port,
        host=host,
        preset=preset,
        kv_blocks=kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        served_model_name=served_model_name,
        time_scale=time_scale,
    )
    try:
        server = SimServer(config)
    except SimConfigError as exc:
        raise fail(str(exc), code=2) from exc
    aio.run(server.serve())


if __name__ == "__main__":  # `up` starts workers this way: without the whole CLI, it starts in a fraction of the time
    typer.run(engine_sim)
