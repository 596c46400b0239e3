"""HTTP routes of the gateway: OpenAI-compatible endpoints plus program control and metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from thunderctl.gateway.admin import WeightSync, admin_routes
from thunderctl.gateway.auth import GatewayAuth, RequireApiKey
from thunderctl.gateway.disconnects import CountDisconnects
from thunderctl.gateway.gateway import Gateway, WorkerError
from thunderctl.gateway.metrics import render_metrics
from thunderctl.gateway.requests import (
    PROGRAM_HEADER,
    as_sent,
    check_generation_fields,
    ends_session,
    pop_docker_ids,
    pop_group_id,
    pop_program_id,
    prompt_shape,
)
from thunderctl.gateway.streaming import RelayedStream
from thunderctl.gateway.views import groups_view, programs_view
from thunderctl.jsonapi import (
    BadRequest,
    BodyLimits,
    bad_request,
    error,
    read_json_body,
    read_json_object,
    valid_program_id,
)


def build_app(
    gateway: Gateway,
    extra_routes: Sequence[BaseRoute] = (),
    extra_metrics: Callable[[], str] | None = None,
    on_docker_ids: Callable[[str, list[str]], None] | None = None,
    on_release: Callable[[str], None] | None = None,
    auth: GatewayAuth = GatewayAuth(),
    limits: BodyLimits = BodyLimits(),
    weight_sync: WeightSync | None = None,
) -> Starlette:
    """The gateway's routes; the daemon adds the sandbox pool's routes, metrics, adoption and
    collection at release (of any program: one may end before its first LLM request). With
    an API key in `auth`, every route but /health (and /metrics, if public) asks for it.
    `weight_sync` serves /admin/pause and /admin/resume (default: with the default bound)."""

    def release_program(program_id: str) -> bool:
        released = gateway.scheduler.release(program_id)
        if on_release is not None:
            on_release(program_id)
        return released

    async def completions(request: Request) -> Response:
        try:
            raw, body = await read_json_body(request, limits)
            sent = as_sent(raw, body)
            headers = dict(request.headers)
            program_id = pop_program_id(body, headers)
            group = pop_group_id(body, headers)
            final = ends_session(headers, program_id)
        except BadRequest as exc:
            return bad_request(exc)
        response = await answer(request.url.path, body, program_id, group, sent)
        if final:
            # The session's last request, whatever its answer: released once the response has
            # gone out (a stream, after its last byte), as POST /programs/release would.
            response.background = BackgroundTask(release_program, program_id)
        return response

    async def answer(
        path: str, body: dict[str, Any], program_id: str | None, group: str | None, sent: bytes | None
    ) -> Response:
        try:
            docker_ids = pop_docker_ids(body)
            check_generation_fields(body)
            shape = prompt_shape(body)
        except BadRequest as exc:
            return bad_request(exc)
        claim = gateway.derived.claim(body) if program_id is None else None
        if claim is not None:
            program_id, group = claim.program_id, group or claim.group
        if docker_ids and program_id is not None and on_docker_ids is not None:
            on_docker_ids(program_id, docker_ids)
        try:
            relayed = await gateway.relay(path, body, program_id, shape, claim, group, sent)
        except (WorkerError, httpx.HTTPError) as exc:
            return error(502, str(exc), "backend_error")
        # The client learns the program it was given, to release it or to name it from now on.
        headers = {PROGRAM_HEADER: claim.program_id} if claim is not None else None
        if isinstance(relayed.body, bytes):
            return Response(relayed.body, relayed.status, headers=headers, media_type=relayed.media_type)
        return RelayedStream(relayed.body, relayed.status, media_type=relayed.media_type, headers=headers)

    async def models(_: Request) -> Response:
        try:
            status, content = await gateway.get_models()
        except WorkerError as exc:
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
        return JSONResponse({"program_id": program_id, "released": release_program(program_id)})

    async def programs(_: Request) -> Response:
        return JSONResponse({"programs": programs_view(gateway), "groups": groups_view(gateway)})

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
            *admin_routes(weight_sync or WeightSync(gateway), limits),
            *extra_routes,
        ],
        middleware=[
            Middleware(CountDisconnects, on_disconnect=gateway.count_client_disconnect),
            Middleware(RequireApiKey, auth=auth),
        ],
    )
