"""`thunderctl engine sim`: its options, made from SimEngineConfig's fields, and running the simulated
worker in the foreground."""

from __future__ import annotations

import inspect
import logging
from dataclasses import fields
from typing import Annotated, Any, get_type_hints

import typer

from thunderctl import aio
from thunderctl.engines.simulated.server import SimConfigError, SimEngineConfig, SimServer
from thunderctl.terminal import fail


def engine_sim(**settings: Any) -> None:
    """Serve a simulated vLLM worker (the simulator's engine model) over vLLM's OpenAI API, in real time."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = SimServer(SimEngineConfig(**settings))
    except SimConfigError as exc:
        raise fail(str(exc), code=2) from exc
    aio.run(server.serve())


def _options() -> inspect.Signature:
    """One --option per SimEngineConfig field, with the field's type, default, help and bounds."""
    types = get_type_hints(SimEngineConfig)
    return inspect.Signature(
        [
            inspect.Parameter(
                item.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=item.default,
                annotation=Annotated[
                    types[item.name], typer.Option(help=item.metadata["help"], **item.metadata["bounds"])
                ],
            )
            for item in fields(SimEngineConfig)
        ]
    )


# typer reads a command's options off its signature.
engine_sim.__signature__ = _options()  # type: ignore[attr-defined]


if __name__ == "__main__":  # `up` starts workers this way: without the whole CLI, it starts in a fraction of the time
    typer.run(engine_sim)
