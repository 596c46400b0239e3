"""HTTP routes of the gateway: OpenAI-compatible endpoints plus program control and metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from thunderctl.gateway.auth import GatewayAuth, RequireApiKey
from thunderctl.gateway.gateway import BackendError, Gateway
from thunderctl.gateway.metrics import render_metrics
from thunderctl.gateway.requests import check_generation_fields, pop_docker_ids, pop_program_id, prompt_shape
from thunderctl.jsonapi import BadRequest, BodyLimits, bad_request, error, read_json_object, valid_program_id


def build_app(
    gateway: Gateway,
    extra_routes: Sequence[BaseRoute] = (),
    extra_metrics: Callable[[], str] | None = None,
    on_docker_ids: Callable[[str, list[str]], None] | None = None,
    on_release: Callable[[str], None] | None = None,
    auth: GatewayAuth = GatewayAuth(),
    limits: BodyLimits = BodyLimits(),
) -> Starlette:
    """The gateway's routes; the daemon adds the sandbox pool's routes, metrics, adoption and
    collection at release (of any program: one may end before its first LLM request). With
    an API key in `auth`, every route but /health (and /metrics, if public) asks for it."""
    async def completions(request: Request) -> Response:
        try:
            body = await read_json_object(request, limits)
            program_id = pop_program_id(body, dict(request.headers))
            docker_ids = pop_docker_ids(body)
            check_generation_fields(body)
            shape = prompt_shape(body)
        except BadRequest as exc:
            return bad_request(exc)
        if docker_ids and program_id is not None and on_docker_ids is not None:
            on_docker_ids(program_id, docker_ids)
        try:
            relayed = await gateway.relay(request.url.path, body, program_id, shape)
        except (BackendError, httpx.HTTPError) as exc:
            return error(502, str(exc), "backend_error")
        if isinstance(relayed.body, bytes):
            return Response(relayed.body, relayed.status, media_type=relayed.media_type)
        return StreamingResponse(relayed.body, relayed.status, media_type=relayed.media_type)

    async def models(_: Request) -> Response:
        try:
            status, content = await gateway.get_models()
        except BackendError as exc:
            return error(502, str(exc), "backend_error")
        return Response(content, status, media_type="application/json")

    async def release(request: Request) -> Response:
        try:
            body = await read_json_object(request, limits)
            if "program_id" not in body:
                raise BadRequest('release needs {"program_id": "<id>"}')
            program_id = valid_program_id(body["program_id"])
        except BadRequest as exc:
            return bad_request(exc)
        released = gateway.scheduler.release(program_id)
        if on_release is not None:
            on_release(program_id)
        return JSONResponse({"program_id": program_id, "released": released})

    async def programs(_: Request) -> Response:
        return JSONResponse({"programs": gateway.programs_view()})

    async def metrics(_: Request) -> Response:
        text = render_metrics(gateway) + (extra_metrics() if extra_metrics else "")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/programs/release", release, methods=["POST"]),
            Route("/programs", programs, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            *extra_routes,
        ],
        middleware=[Middleware(RequireApiKey, auth=auth)],
    )
