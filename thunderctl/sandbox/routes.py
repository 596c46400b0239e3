"""`/v1/sandboxes`: the sandbox pool over HTTP, mounted by the daemon on the gateway's port."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from thunderctl.jsonapi import (
    MAX_CONTAINER_REF_CHARS,
    BadRequest,
    BodyLimits,
    error,
    read_json_object,
    valid_program_id,
)
from thunderctl.sandbox.host import HostUnavailable, ImageUnavailable, SandboxError
from thunderctl.sandbox.lease import AdoptionRefused, PoolUnavailable, SandboxFailed, SandboxNotFound, SandboxState
from thunderctl.sandbox.pool import SandboxPool

Endpoint = Callable[[Request], Awaitable[Response]]
Body = TypeVar("Body", bound=BaseModel)
# Docker takes no NUL byte in an argument, a name or the environment: refused here, as a 400.
Text = Annotated[str, Field(pattern=r"^[^\x00]*$")]
NonEmpty = Annotated[str, Field(min_length=1, pattern=r"^[^\x00]+$")]
ContainerRef = Annotated[str, Field(min_length=1, max_length=MAX_CONTAINER_REF_CHARS, pattern=r"^[^\x00]+$")]
ImageRef = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^\S+$")]
EnvName = Annotated[str, Field(min_length=1, pattern=r"^[^\x00=]+$")]
ProgramId = Annotated[str, BeforeValidator(valid_program_id)]

DEFAULT_WAIT_S = 60.0
MAX_WAIT_S = 600.0


def error_response(exc: Exception) -> JSONResponse:
    match exc:
        case BadRequest():
            return error(exc.status, str(exc), "invalid_request_error")
        case SandboxNotFound():
            return error(404, str(exc), "not_found")
        case AdoptionRefused():
            return error(403, str(exc), "adoption_refused")
        case SandboxFailed() | ImageUnavailable():
            return error(422, str(exc), "sandbox_failed")
        case PoolUnavailable() | HostUnavailable():
            return error(503, str(exc), "sandboxes_unavailable")
        case _:
            return error(502, str(exc), "docker_error")


class StrictBody(BaseModel):
    """JSON types as given (no "5" for 5, no 1 for true) and no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class CreateBody(StrictBody):
    program_id: ProgramId
    image: ImageRef | None = None
    env: dict[EnvName, Text] | None = None
    setup: Text | None = None


class AdoptBody(StrictBody):
    program_id: ProgramId
    docker_ids: list[ContainerRef] = Field(min_length=1)


class ExecBody(StrictBody):
    cmd: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)] = Field(union_mode="left_to_right")
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)


def parse(model: type[Body], body: dict) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # Each part of a location is cut short: a key of the client's could be megabytes long.
        problems = "; ".join(
            f"{'.'.join(str(part)[:64] for part in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise BadRequest(f"bad request body: {problems}") from exc


def wait_seconds(request: Request) -> float:
    raw = request.query_params.get("timeout", str(DEFAULT_WAIT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise BadRequest(f"timeout must be a number of seconds, not {raw[:64]!r}")
    return min(max(seconds, 0.0), MAX_WAIT_S)


def sandbox_routes(pool: SandboxPool, limits: BodyLimits = BodyLimits()) -> list[Route]:
    async def create(request: Request) -> Response:
        body = parse(CreateBody, await read_json_object(request, limits))
        sandbox = await pool.acquire(body.program_id, image=body.image, env=body.env, setup=body.setup)
        return JSONResponse(sandbox.view(), 201)

    async def adopt(request: Request) -> Response:
        body = parse(AdoptBody, await read_json_object(request, limits))
        adopted = await pool.adopt(body.program_id, body.docker_ids)
        return JSONResponse({"program_id": body.program_id, "sandboxes": [sb.view() for sb in adopted]})

    async def listing(request: Request) -> Response:
        program_id = request.query_params.get("program_id")
        if program_id is not None:
            program_id = valid_program_id(program_id, "the program_id query parameter")
        return JSONResponse({"sandboxes": [sb.view() for sb in pool.sandboxes(program_id)]})

    async def show(request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        if request.query_params.get("wait") == "ready":
            sandbox = await pool.wait_ready(sandbox_id, wait_seconds(request))
        else:
            sandbox = pool.get(sandbox_id)
        if sandbox.state is SandboxState.RELEASED:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} was released")
        if sandbox.state is SandboxState.FAILED:
            return JSONResponse(
                {"error": {"message": sandbox.error, "type": "sandbox_failed", "code": 422}, "sandbox": sandbox.view()},
                422,
            )
        return JSONResponse(sandbox.view())

    async def run(request: Request) -> Response:
        body = parse(ExecBody, await read_json_object(request, limits))
        result = await pool.exec(request.path_params["sandbox_id"], body.cmd, body.timeout)
        return JSONResponse(asdict(result))

    async def delete(request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        await pool.release(sandbox_id)
        return JSONResponse({"id": sandbox_id, "state": str(SandboxState.RELEASED)})

    def guarded(handler: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except (BadRequest, SandboxError) as exc:
                return error_response(exc)

        return endpoint

    return [
        Route("/v1/sandboxes", guarded(create), methods=["POST"]),
        Route("/v1/sandboxes", guarded(listing), methods=["GET"]),
        Route("/v1/sandboxes/adopt", guarded(adopt), methods=["POST"]),
        Route("/v1/sandboxes/{sandbox_id}", guarded(show), methods=["GET"]),
        Route("/v1/sandboxes/{sandbox_id}", guarded(delete), methods=["DELETE"]),
        Route("/v1/sandboxes/{sandbox_id}/exec", guarded(run), methods=["POST"]),
    ]
