"""HTTP routes of the gateway: the engines' generation APIs (scheduled), their other public routes
(relayed), program control and metrics. The engines' control routes are never a client's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from thunderctl.gateway.admin import WeightSync, admin_routes
from thunderctl.gateway.admissions import ChainStep
from thunderctl.gateway.apis import CHAT, GENERATION_ROUTES, MESSAGES, Api
from thunderctl.gateway.auth import GatewayAuth, RequireApiKey
from thunderctl.gateway.chains import not_found
from thunderctl.gateway.disconnects import CountDisconnects
from thunderctl.gateway.gateway import Gateway
from thunderctl.gateway.metrics import render_metrics
from thunderctl.gateway.relay import Relay, WorkerError
from thunderctl.gateway.requests import (
    PROGRAM_HEADER,
    Named,
    as_sent,
    forwarded_headers,
    named_program,
    pop_docker_ids,
)
from thunderctl.gateway.routes import CONTROL_PATHS, RELAYED_ROUTES, served_paths
from thunderctl.gateway.streaming import RelayedStream
from thunderctl.gateway.views import groups_view, programs_view
from thunderctl.jsonapi import (
    BadRequest,
    BodyLimits,
    bad_request,
    error,
    read_body,
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

    keyed = auth.api_key is not None

    def release_program(program_id: str) -> bool:
        released = gateway.scheduler.release(program_id)
        if on_release is not None:
            on_release(program_id)
        return released

    async def stored_response(request: Request) -> Response:
        """`GET /v1/responses/{id}`: the gateway's copy; `POST …/cancel`: as vLLM answers for a response
        that is over (the gateway runs no background responses)."""
        response_id = request.path_params["response_id"]
        kept = gateway.chains.get(response_id)
        if kept is None:
            return not_found(response_id)
        if request.method == "POST":
            return error(400, "Cannot cancel a synchronous response.")
        return JSONResponse(kept.response)

    async def control(request: Request) -> Response:
        return error(
            403,
            f"{request.url.path} is an engine's control route, which only the cluster calls: pause and resume the "
            "workers with `thunderctl pause` / `thunderctl resume` (POST /admin/pause, /admin/resume with the key)",
            "permission_error",
        )

    async def not_served(request: Request) -> Response:
        api = MESSAGES if request.url.path.startswith("/v1/messages") else CHAT
        return api.error(
            404,
            f"{request.method} {request.url.path} is not served here; the gateway serves: {', '.join(served_paths())}",
            "not_found_error",
        )

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
            *relay_routes(gateway.relay, keyed, limits, on_docker_ids, release_program),
            Route("/v1/responses/{response_id}", stored_response, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"]),
            *(Route(path, control, methods=["GET", "POST", "PUT", "DELETE"]) for path in CONTROL_PATHS),
            Route("/programs/release", release, methods=["POST"]),
            Route("/programs", programs, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            *admin_routes(weight_sync or WeightSync(gateway), limits),
            *extra_routes,
            Route("/{path:path}", not_served, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ],
        middleware=[
            Middleware(CountDisconnects, on_disconnect=gateway.count_client_disconnect),
            Middleware(RequireApiKey, auth=auth),
        ],
    )


def relay_app(
    relay: Relay,
    fallback: ASGIApp,
    on_docker_ids: Callable[[str, list[str]], None],
    on_release: Callable[[str], object],
    on_disconnect: Callable[[], int],
    auth: GatewayAuth = GatewayAuth(),
    limits: BodyLimits = BodyLimits(),
) -> Starlette:
    """A relay process's app: the engines' routes (`relay_routes`), every other route handed to
    `fallback` (the daemon's gateway, which serves programs, metrics and control)."""
    return Starlette(
        routes=[
            *relay_routes(relay, auth.api_key is not None, limits, on_docker_ids, on_release),
            Route("/{path:path}", fallback, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ],
        middleware=[
            Middleware(CountDisconnects, on_disconnect=on_disconnect),
            Middleware(RequireApiKey, auth=auth),
        ],
    )


def relay_routes(
    relay: Relay,
    keyed: bool,
    limits: BodyLimits,
    on_docker_ids: Callable[[str, list[str]], None] | None,
    on_release: Callable[[str], object],
) -> list[Route]:
    """The engines' routes, as a relay serves them (in the gateway's process or a relay process of
    its own): the generation APIs scheduled through `relay`'s scheduler side, the others relayed.
    `keyed`: clients send the gateway's key (it goes on to no worker); `on_docker_ids`: a request
    named its sandboxes; `on_release`: the session's last request has been answered."""

    def generation(api: Api) -> Callable[[Request], Awaitable[Response]]:
        async def generate(request: Request) -> Response:
            try:
                raw, body = await read_json_body(request, limits)
                sent = as_sent(raw, body)
                named = named_program(body, request.headers, api.program_hints(body))
            except BadRequest as exc:
                return api.error(exc.status, str(exc))
            response = await answer(api, request, body, named, sent)
            if named.final:
                # The session's last request, whatever its answer: released once the response has
                # gone out (a stream, after its last byte), as POST /programs/release would.
                response.background = BackgroundTask(on_release, named.program_id)
            return response

        return generate

    async def answer(api: Api, request: Request, body: dict[str, Any], named: Named, sent: bytes | None) -> Response:
        try:
            docker_ids = pop_docker_ids(body)
            api.check(body)
        except BadRequest as exc:
            return api.error(exc.status, str(exc))
        program_id, group, chain = named.program_id, named.group, None
        if api.chained:
            previous = body.pop("previous_response_id", None)
            own_input = api.own_input(body)
            if previous is not None:
                kept = await relay.admissions.chain(previous)
                if kept is None:
                    return not_found(previous)
                # The worker gets the whole chain: whichever worker served its turns, this one has it all.
                body["input"], sent = [*kept.items, *own_input], None
                program_id = program_id or kept.program_id
            if body.get("store") is not False:
                chain = ChainStep(program_id, previous, own_input)
        turn = api.turn(body)
        shape = api.shape(body, turn)
        followed = await relay.follow(turn) if program_id is None else None
        if followed is not None:
            program_id, group = followed.program_id, group or followed.group
        if docker_ids and program_id is not None and on_docker_ids is not None:
            on_docker_ids(program_id, docker_ids)
        try:
            relayed = await relay.relay(
                api, request.url.path, body, program_id, shape, followed, group, sent, named.parent,
                forwarded_headers(request.headers, keyed), chain,
            )  # fmt: skip
        except (WorkerError, httpx.HTTPError) as exc:
            return api.error(502, str(exc), "backend_error")
        # The client learns the program it was given, to release it or to name it from now on.
        headers = {PROGRAM_HEADER: followed.program_id} if followed is not None else None
        if isinstance(relayed.body, bytes):
            return Response(relayed.body, relayed.status, headers=headers, media_type=relayed.media_type)
        return RelayedStream(relayed.body, relayed.status, media_type=relayed.media_type, headers=headers)

    def relayed(api: Api) -> Callable[[Request], Awaitable[Response]]:
        """An engine route the gateway does not schedule, relayed to a worker (errors in `api`'s shape)."""

        async def relayed_request(request: Request) -> Response:
            try:
                body = await read_body(request, limits.max_bytes)
            except BadRequest as exc:
                return api.error(exc.status, str(exc))
            try:
                answer = await relay.forward(
                    request.method, request.url.path, request.url.query, body, forwarded_headers(request.headers, keyed),
                    request.headers.get(PROGRAM_HEADER),
                )  # fmt: skip
            except WorkerError as exc:
                return api.error(502, str(exc), "backend_error")
            assert isinstance(answer.body, bytes)
            return Response(answer.body, answer.status, media_type=answer.media_type)

        return relayed_request

    return [
        *(Route(path, generation(api), methods=["POST"]) for path, api in GENERATION_ROUTES.items()),
        *(Route(r.path, relayed(r.api), methods=[r.method]) for r in RELAYED_ROUTES),
    ]
