"""Pytest plugin: a real Docker engine, a locally built test image, and sandbox pools on it.

The engine is the one scripts/start-dockerd.sh starts. The image is built FROM scratch with
Debian's busybox-static (no registry is reachable). Every pool gets a cluster name of its own,
and whatever containers carry that name are removed after the test, whatever the test did.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import io
import json
import re
import secrets
import tarfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docker
import httpx
import pytest
import uvicorn
from docker.errors import DockerException, ImageNotFound
from starlette.applications import Starlette

from thunderctl.processes import pick_free_port
from thunderctl.sandbox import SandboxConfig, SandboxPool, sandbox_routes
from thunderctl.sandbox.busybox import BusyboxMissing, build_busybox_image

TEST_IMAGE = "thunderctl-test/busybox:latest"
TEST_LABEL = "thunderctl.test"  # on everything the tests make outside a pool
REGISTRY_PATH = re.compile(r"^/v2/(?P<repository>.+)/(?P<kind>manifests|blobs)/(?P<reference>[^/]+)$")
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"


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
def sandbox_image(docker_client: docker.DockerClient) -> Iterator[str]:
    try:
        image = build_busybox_image(docker_client, TEST_IMAGE, {TEST_LABEL: "1"})
    except BusyboxMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield TEST_IMAGE
    for container in docker_client.containers.list(all=True, filters={"label": TEST_LABEL}):
        container.remove(force=True, v=True)
    # Images built from it (and pulled copies of them) carry the label too; pools are shut down by
    # now, so no container holds any of them.
    made_ids = [made.id for made in docker_client.images.list(all=True, filters={"label": TEST_LABEL})]
    for image_id in [*(i for i in made_ids if i != image.id), image.id]:
        # Another test run on the same engine may have removed it already: gone is what we want.
        with contextlib.suppress(ImageNotFound):
            docker_client.images.remove(image_id, force=True)


@pytest.fixture(scope="module")
def module_sandbox_image(docker_client: docker.DockerClient) -> Iterator[str]:
    """The test image under a tag and label of the module's own, for modules whose cluster runs for
    minutes: the session-wide image is removed by id when any pytest session on the machine ends
    (the same build gives the same id), which a shared machine's other sessions do at any time."""
    tag = f"thunderctl-test/module-busybox:{secrets.token_hex(3)}"
    image = build_busybox_image(docker_client, tag, {"thunderctl.module-test": tag})
    yield tag
    with contextlib.suppress(ImageNotFound):
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
        defaults = dict(
            image=sandbox_image,
            memory="64m",
            pids=64,
            nofile=1024,
            cpus=0.5,
            prepare_concurrency=4,
            maintenance_interval_s=3600,
        )
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


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused at once."""
    return pick_free_port()


@pytest.fixture
async def serve_pool() -> AsyncIterator[Callable[[SandboxPool], Awaitable[httpx.AsyncClient]]]:
    """Serve a pool's /v1/sandboxes routes over real HTTP on loopback, in the test's event loop."""
    servers: list[tuple[uvicorn.Server, asyncio.Task, httpx.AsyncClient]] = []

    async def serve(pool: SandboxPool) -> httpx.AsyncClient:
        port = pick_free_port()
        config = uvicorn.Config(
            Starlette(routes=sandbox_routes(pool)), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
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


class LoopbackRegistry:
    """A read-only Docker registry (HTTP API v2) on loopback, serving images saved from the local
    engine: the pool pulls for real without any registry outside this machine. Docker treats
    127.0.0.0/8 registries as insecure, so plain HTTP is accepted."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[tuple[str, str], bytes] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def publish(self, saved: bytes, repository: str, tag: str) -> str:
        """Serve a `docker save` archive as repository:tag; returns the reference to pull."""
        with tarfile.open(fileobj=io.BytesIO(saved)) as archive:
            [entry] = json.load(archive.extractfile("manifest.json"))
            config = archive.extractfile(entry["Config"]).read()
            layers = [gzip.compress(archive.extractfile(path).read(), mtime=0) for path in entry["Layers"]]
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": self._descriptor(config, "application/vnd.docker.container.image.v1+json"),
            "layers": [
                self._descriptor(layer, "application/vnd.docker.image.rootfs.diff.tar.gzip") for layer in layers
            ],
        }
        content = json.dumps(manifest).encode()
        # Docker asks for the manifest by tag, then again by the digest it was told.
        for reference in (tag, "sha256:" + hashlib.sha256(content).hexdigest()):
            self.manifests[(repository, reference)] = content
        return f"{self.address}/{repository}:{tag}"

    def _descriptor(self, blob: bytes, media_type: str) -> dict:
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        self.blobs[digest] = blob
        return {"mediaType": media_type, "size": len(blob), "digest": digest}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                self._answer(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                content, media_type = self._lookup()
                self.send_response(200 if content is not None else 404)
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                content = content if content is not None else b"{}"
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(content)))
                self.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(content).hexdigest())
                self.end_headers()
                if body:
                    self.wfile.write(content)

            def _lookup(self) -> tuple[bytes | None, str]:
                path = self.path.split("?")[0]
                if path in ("/v2", "/v2/"):
                    return b"{}", "application/json"
                match = REGISTRY_PATH.match(path)
                if match is None:
                    return None, "application/json"
                if match["kind"] == "manifests":
                    return registry.manifests.get((match["repository"], match["reference"])), MANIFEST_TYPE
                return registry.blobs.get(match["reference"]), "application/octet-stream"

            def log_message(self, *_: object) -> None:
                pass  # quiet: pytest shows failures, not every pull

        return Handler


@pytest.fixture(scope="session")
def loopback_registry() -> Iterator[LoopbackRegistry]:
    registry = LoopbackRegistry()
    yield registry
    registry.close()


@pytest.fixture
def publish_image(
    docker_client: docker.DockerClient,
    sandbox_image: str,
    loopback_registry: LoopbackRegistry,
    tmp_path: Path,
) -> Callable[[], str]:
    """Publish a new image (the test image plus a file of its own) on the loopback registry, absent
    from the engine, so that using it means pulling it. Pulled copies carry the test label: the
    session's end removes them."""

    def publish() -> str:
        tag = secrets.token_hex(4)
        (tmp_path / "Dockerfile").write_text(f"FROM {sandbox_image}\nRUN echo {tag} > /pulled\n")
        image, _ = docker_client.images.build(path=str(tmp_path), rm=True, labels={TEST_LABEL: "1"})
        saved = b"".join(image.save())
        docker_client.images.remove(image.id, force=True)
        return loopback_registry.publish(saved, "thunderctl-test/pullable", tag)

    return publish
