"""Pytest plugin: a real Docker engine, a locally built test image, and sandbox pools on it.

The engine is the one scripts/start-dockerd.sh starts. The image is built FROM scratch with
Debian's busybox-static (no registry is reachable). Every pool gets a cluster name of its own,
and whatever containers carry that name are removed after the test, whatever the test did.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import docker
import httpx
import pytest
import uvicorn
from docker.errors import DockerException
from starlette.applications import Starlette

from thunderctl.sandbox import SandboxConfig, SandboxPool, sandbox_routes

TEST_IMAGE = "thunderctl-test/busybox:latest"
TEST_LABEL = "thunderctl.test"  # on everything the tests make outside a pool
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: runs in an image with no libc
DOCKERFILE = 'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "--install", "-s", "/bin"]\n'


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env()
        client.ping()
    except DockerException as exc:
        # A missing engine is a broken setup, not a reason to skip: fail loudly.
        pytest.fail(f"no Docker engine answers ({exc}): run scripts/start-dockerd.sh as root", pytrace=False)
    yield client
    client.close()


@pytest.fixture(scope="session")
def sandbox_image(docker_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not BUSYBOX.exists():
        pytest.fail(f"{BUSYBOX} is missing: run scripts/start-dockerd.sh (installs busybox-static)", pytrace=False)
    context = tmp_path_factory.mktemp("sandbox-image")
    shutil.copy(BUSYBOX, context / "busybox")
    (context / "Dockerfile").write_text(DOCKERFILE)
    image, _ = docker_client.images.build(path=str(context), tag=TEST_IMAGE, rm=True, labels={TEST_LABEL: "1"})
    yield TEST_IMAGE
    for container in docker_client.containers.list(all=True, filters={"label": TEST_LABEL}):
        container.remove(force=True, v=True)
    docker_client.images.remove(image.id, force=True)


@pytest.fixture
def sandbox_cluster(docker_client: docker.DockerClient) -> Iterator[str]:
    """A cluster name of the test's own; its containers are removed afterwards whatever happened."""
    cluster = f"test-{secrets.token_hex(4)}"
    yield cluster
    for container in docker_client.containers.list(all=True, filters={"label": f"thunderctl.cluster={cluster}"}):
        container.remove(force=True, v=True)


@pytest.fixture
def sandbox_config(sandbox_image: str) -> Callable[..., SandboxConfig]:
    """Test defaults: the busybox image, small limits, and no background maintenance (tests call
    `pool.maintain()` when they mean it)."""

    def make(**overrides: object) -> SandboxConfig:
        defaults = dict(image=sandbox_image, memory="64m", pids=64, nofile=1024, cpus=0.5,
                        prepare_concurrency=4, maintenance_interval_s=3600)
        return SandboxConfig(**(defaults | overrides))

    return make


@pytest.fixture
async def start_pool(
    sandbox_config: Callable[..., SandboxConfig], sandbox_cluster: str
) -> AsyncIterator[Callable[..., Awaitable[SandboxPool]]]:
    """Start pools of the test's cluster; each is shut down (all containers removed) afterwards."""
    pools: list[SandboxPool] = []

    async def start(state_path: Path | None = None, **overrides: object) -> SandboxPool:
        pool = SandboxPool(sandbox_config(**overrides), cluster=sandbox_cluster, state_path=state_path)
        pools.append(pool)
        await pool.start()
        return pool

    yield start
    for pool in pools:
        await pool.shutdown()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused at once."""
    return free_port()


@pytest.fixture
async def serve_pool() -> AsyncIterator[Callable[[SandboxPool], Awaitable[httpx.AsyncClient]]]:
    """Serve a pool's /v1/sandboxes routes over real HTTP on loopback, in the test's event loop."""
    servers: list[tuple[uvicorn.Server, asyncio.Task, httpx.AsyncClient]] = []

    async def serve(pool: SandboxPool) -> httpx.AsyncClient:
        port = free_port()
        config = uvicorn.Config(Starlette(routes=sandbox_routes(pool)), host="127.0.0.1", port=port,
                                log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()  # raises why it stopped
            await asyncio.sleep(0.01)
        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        servers.append((server, task, client))
        return client

    yield serve
    for server, task, client in servers:
        await client.aclose()
        server.should_exit = True
        await task
