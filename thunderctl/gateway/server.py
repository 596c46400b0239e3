"""Running the gateway app under uvicorn, in the foreground of the current event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from thunderctl.gateway.admin import WeightSync
from thunderctl.gateway.app import build_app
from thunderctl.gateway.auth import GatewayAuth
from thunderctl.gateway.gateway import AGENT_KEEPALIVE_S, Gateway
from thunderctl.gateway.links import WorkerLink
from thunderctl.jsonapi import BodyLimits
from thunderctl.scheduler.pause import AdminConfig

# Connections the kernel queues for the gateway to accept: uvicorn's default (2,048) is no more
# than a cluster's agents, who all reconnect at once after a restart of the daemon (the kernel
# caps it at net.core.somaxconn, 4,096 on current Linux).
AGENT_BACKLOG = 4096


def server_config(app: ASGIApp, backlog: int = AGENT_BACKLOG, **bind: Any) -> uvicorn.Config:
    """uvicorn's settings for a gateway: agents' idle connections kept longer than their clients
    keep them (AGENT_KEEPALIVE_S), a listen queue of `backlog`, no access log; `bind`: host, port."""
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=AGENT_KEEPALIVE_S,
        backlog=backlog,
        **bind,
    )


def parse_worker(spec: str, index: int) -> WorkerLink:
    """`URL` or `ID=URL`; the id defaults to the URL's host:port."""
    worker_id, sep, url = spec.partition("=")
    if not sep:
        worker_id, url = "", spec
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend {spec!r}: expected http://HOST:PORT (optionally ID=URL)")
    return WorkerLink(worker_id or url.split("://", 1)[1] or f"backend-{index}", url)


async def serve_gateway(
    gateway: Gateway,
    host: str,
    port: int,
    on_ready: Callable[[list[str]], None],
    auth: GatewayAuth = GatewayAuth(),
    limits: BodyLimits = BodyLimits(),
    admin: AdminConfig | None = None,
) -> None:
    """Check the workers, then serve until interrupted; the gateway's loops stop with it."""
    try:
        warnings = await gateway.start()  # a worker that does not answer raises here: close the client all the same
        app = build_app(gateway, auth=auth, limits=limits, weight_sync=WeightSync(gateway, admin))
        server = uvicorn.Server(server_config(app, host=host, port=port))
        on_ready(warnings)
        await server.serve()
    finally:
        await gateway.stop()
