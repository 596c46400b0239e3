"""Pytest plugin: the HTTP APIs without engines. A loopback OpenAI-style worker that answers at
once and records what it was sent, the gateway app in front of it in-process, a sandbox pool
whose Docker host is never reached, and a daemon over a state directory (registered from conftest.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.cluster.worker_key import worker_key_path
from thunderctl.daemon.service import Daemon
from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.auth import GatewayAuth
from thunderctl.jsonapi import BodyLimits
from thunderctl.processes import pick_free_port
from thunderctl.profile import DEFAULT_PROFILE
from thunderctl.sandbox import SandboxConfig, SandboxPool

FAKE_METRICS = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",engine="0"} 1.0\n'
USAGE = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}


@dataclass
class FakeBackend:
    """Answers like vLLM (chat, completions, models, health, metrics); with `key`, its /v1
    routes ask for it as vLLM's do. `authorizations` holds the header of every /v1 request."""

    url: str
    key: str | None = None
    authorizations: list[str | None] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)  # of every completion request

    def app(self) -> Starlette:
        async def completion(request: Request) -> Response:
            self.authorizations.append(request.headers.get("authorization"))
            if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": "Unauthorized"}, 401)
            body = await request.json()
            self.bodies.append(body)
            if body.get("stream"):
                chunks = [
                    'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
                    f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n",
                    "data: [DONE]\n\n",
                ]
                return StreamingResponse(iter(chunks), media_type="text/event-stream")
            return JSONResponse(
                {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}], "usage": USAGE}
            )

        async def models(request: Request) -> Response:
            self.authorizations.append(request.headers.get("authorization"))
            return JSONResponse({"data": [{"id": "fake", "max_model_len": 4096}]})

        return Starlette(routes=[
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", lambda _: PlainTextResponse("")),
            Route("/metrics", lambda _: PlainTextResponse(FAKE_METRICS)),
        ])  # fmt: skip


class FakeBackends:
    """Fake workers kept running for the session, each served by uvicorn in a thread of its own,
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
            return worker
        port = pick_free_port()
        worker = FakeBackend(f"http://127.0.0.1:{port}", key)
        server = uvicorn.Server(uvicorn.Config(worker.app(), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake worker did not start")
            time.sleep(0.01)
        return worker

    def stop(self) -> None:
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(timeout=10)


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


@pytest.fixture
async def gateway_app(fake_backend) -> AsyncIterator[Callable[..., object]]:
    """The gateway's app in front of a fake worker, spoken to in-process (httpx ASGITransport).
    Returns (client, worker); the gateway's loops stop at the end."""
    started: list[tuple[Gateway, httpx.AsyncClient]] = []

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
        app = build_app(gateway, extra_routes=extra_routes or (), on_release=on_release, auth=auth, limits=limits)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        started.append((gateway, client))
        return client, worker

    yield make
    for gateway, client in started:
        await client.aclose()
        await gateway.stop()


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
