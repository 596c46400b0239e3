"""Pytest plugin: the HTTP APIs without real engines. A loopback simulated vLLM worker (the
simulated engine's app, stepping as fast as it can) that records what it was sent, the gateway
app in front of it in-process, a sandbox pool whose Docker host is never reached, and a daemon
over a state directory (registered from conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from support import relays_apart, wait_for
from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.cluster.worker_key import worker_key_path
from thunderctl.daemon.service import Daemon
from thunderctl.engines.simulated.server import SimEngineConfig, SimServer
from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.auth import GatewayAuth
from thunderctl.jsonapi import BodyLimits
from thunderctl.processes import pick_free_port
from thunderctl.profile import DEFAULT_PROFILE
from thunderctl.sandbox import SandboxConfig, SandboxPool


@dataclass
class FakeBackend:
    """A simulated vLLM worker that records the Authorization header of every /v1 request
    (`authorizations`) and the body of every completion request (`bodies`, and as bytes in `raw_bodies`), and the method,
    path (with its query) and headers of every request (`requests`); with `key`, its /v1 routes ask for it as vLLM's
    `--api-key` does. Its engine: model "fake", 4,096 KV blocks of 16
    tokens, max_model_len 4,096."""

    url: str
    key: str | None = None
    authorizations: list[str | None] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    raw_bodies: list[bytes] = field(default_factory=list)
    requests: list[tuple[str, str, Headers]] = field(default_factory=list)

    def recording(self, engine: ASGIApp) -> ASGIApp:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                query = scope["query_string"].decode()
                self.requests.append(
                    (scope["method"], scope["path"] + (f"?{query}" if query else ""), Headers(scope=scope))
                )
            if scope["type"] == "http" and scope["path"].startswith("/v1/"):
                authorization = Headers(scope=scope).get("authorization")
                self.authorizations.append(authorization)
                if self.key and authorization != f"Bearer {self.key}":
                    await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
                    return
                if scope["method"] == "POST":
                    body = await Request(scope, receive).body()
                    self.bodies.append(json.loads(body))
                    self.raw_bodies.append(body)
                    receive = replaying(body, receive)
            await engine(scope, receive, send)

        return app


def replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` with the request body, already read, handed out again first."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again


class FakeBackends:
    """Simulated workers kept running for the session, each served by uvicorn in a thread of its own,
    and handed out as new: a server's start and stop cost a third of a second, and dozens of tests want one."""

    def __init__(self) -> None:
        self.servers: list[tuple[uvicorn.Server, threading.Thread]] = []
        self.idle: list[FakeBackend] = []

    def take(self, key: str | None) -> FakeBackend:
        """One that nothing uses, with nothing recorded, asking for `key`."""
        if self.idle:
            worker = self.idle.pop()
            worker.key = key
            worker.authorizations.clear()
            worker.bodies.clear()
            worker.raw_bodies.clear()
            worker.requests.clear()
            return worker
        port = pick_free_port()
        worker = FakeBackend(f"http://127.0.0.1:{port}", key)
        sim = SimServer(
            SimEngineConfig(
                port, served_model_name="fake", kv_blocks=4096, block_size=16, max_model_len=4096, time_scale=0
            )
        )
        config = uvicorn.Config(worker.recording(sim.app()), host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=asyncio.run, args=(serve_stepping(server, sim),), daemon=True)
        thread.start()
        self.servers.append((server, thread))
        wait_for(lambda: server.started, 10, "the simulated worker to start")
        return worker

    def stop(self) -> None:
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(timeout=10)


async def serve_stepping(server: uvicorn.Server, sim: SimServer) -> None:
    """uvicorn serving the simulated engine, whose steps run on the same loop."""
    steps = asyncio.create_task(sim.runner.run())
    try:
        await server.serve()
    finally:
        steps.cancel()


@pytest.fixture(scope="session")
def fake_backends() -> Iterator[FakeBackends]:
    workers = FakeBackends()
    yield workers
    workers.stop()


@pytest.fixture
def fake_backend(fake_backends: FakeBackends) -> Iterator[Callable[..., FakeBackend]]:
    """Fake workers on loopback, as new to each test (asking for `key`, having recorded nothing)."""
    taken: list[FakeBackend] = []

    def take(key: str | None = None) -> FakeBackend:
        taken.append(fake_backends.take(key))
        return taken[-1]

    yield take
    fake_backends.idle.extend(taken)


@pytest.fixture
def unreached_pool(tmp_path: Path) -> SandboxPool:
    """A pool that was never started, on a Docker host nothing listens on: any request that
    gets as far as the pool is answered 503, so a 4xx proves it was refused before."""
    config = SandboxConfig(hosts=[f"tcp://127.0.0.1:{pick_free_port()}"])
    return SandboxPool(config, cluster="never-reached", state_path=tmp_path / "sandboxes.json")


@pytest.fixture(params=[1, 2], ids=["one-process", "two-relays"])
async def gateway_app(fake_backend, request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., object]]:
    """The gateway's app in front of a fake worker, spoken to in-process (httpx ASGITransport): the
    one process's, or two relays' taking requests in turn (support.relays_apart). Returns
    (client, worker); the gateway's loops stop at the end."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(
            auth: GatewayAuth = GatewayAuth(),
            limits: BodyLimits = BodyLimits(),
            worker_key: str | None = None,
            extra_routes: list[BaseRoute] | None = None,
            on_release: Callable[[str], None] | None = None,
        ) -> tuple[httpx.AsyncClient, FakeBackend]:
            worker = fake_backend(worker_key)
            gateway = Gateway([WorkerLink("fake", worker.url)], worker_key=worker_key)
            await gateway.start()
            stack.push_async_callback(gateway.stop)
            app = build_app(gateway, extra_routes=extra_routes or (), on_release=on_release, auth=auth, limits=limits)
            if request.param > 1:
                app = await stack.enter_async_context(
                    relays_apart(gateway, request.param, app, auth, limits, on_release)
                )
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
            stack.push_async_callback(client.aclose)
            return client, worker

        yield make


@pytest.fixture
def daemon_of(tmp_path: Path, fake_backend) -> Callable[..., Daemon]:
    """A daemon over a state directory whose one worker is a fake worker (asking for
    `worker_key`, kept where `up` keeps it), its profile's gateway changed by `gateway`. Nothing
    is started: its apps are spoken to in-process, after `await daemon.gateway.start()`."""

    def make(worker_key: str | None = None, **gateway: object) -> Daemon:
        profile = yaml.safe_load(DEFAULT_PROFILE.read_text())
        profile["gateway"] |= gateway
        profile["sandboxes"] = {"enabled": False}
        profile_path = tmp_path / "profile.yaml"
        profile_path.write_text(yaml.safe_dump(profile))
        state = ClusterState("local", tmp_path / "state", str(profile_path), "http://127.0.0.1:8300/v1")
        state.workers.append(WorkerRecord("local/0", "local", fake_backend(worker_key).url, 0, "w.log"))
        state.save()
        if worker_key:
            worker_key_path(state.dir).write_text(worker_key)
        return Daemon(ClusterState.load(state.dir))

    return make
