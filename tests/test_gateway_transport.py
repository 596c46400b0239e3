"""The gateway's own HTTP to its workers (httpx over aiohttp), over real loopback HTTP: simulated
workers in real processes, a silent server and a closed port. Streams and whole answers arrive as
the engine sent them with their usage accounted, a worker that went away is failed over, and
aiohttp's failures reach the gateway as the httpx errors it acts on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from support import accept_queue, connect_unaccepted, wait_for
from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.identity import IdentityConfig
from thunderctl.gateway.transport import AiohttpTransport
from thunderctl.gateway.views import programs_view
from thunderctl.processes import pick_free_port
from thunderctl.scheduler.placement import home

pytestmark = pytest.mark.anyio

MODEL = "sim"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def chat(**extra: object) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "list the files"}], "max_tokens": 12}
    return body | {"program_id": "p1"} | extra


def sse_chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def gateway_client(gateway: Gateway) -> httpx.AsyncClient:
    assert await gateway.start() == []
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://gateway")


async def test_a_stream_and_a_whole_answer_arrive_as_the_engine_sent_them(start_sim) -> None:
    sim = start_sim("--time-scale", "0", "--served-model-name", MODEL)
    gateway = Gateway([WorkerLink("w0", sim.url)])
    client = await gateway_client(gateway)
    try:
        async with httpx.AsyncClient() as direct:
            expected = (await direct.post(f"{sim.url}/v1/chat/completions", json=chat(stream=True))).text
        response = await client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        # The same words (ids and times differ per request), no usage chunk: the client did not ask.
        relayed, sent = sse_chunks(response.text), sse_chunks(expected)
        assert [c["choices"] for c in relayed] == [c["choices"] for c in sent]
        assert response.text.endswith("data: [DONE]\n\n")
        seen = programs_view(gateway)[0]
        assert seen["steps"] == 1 and seen["tokens"] > 12  # the engine's usage: prompt + 12 answer tokens

        whole = await client.post("/v1/chat/completions", json=chat())
        assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 12
        assert programs_view(gateway)[0]["steps"] == 2
        assert gateway.links["w0"].in_flight == 0
    finally:
        await client.aclose()
        await gateway.stop()


async def test_a_worker_that_went_away_is_failed_over_to_the_other(start_sim) -> None:
    live, gone = (start_sim("--time-scale", "0", "--served-model-name", MODEL) for _ in range(2))
    # Unscheduled (nothing derived), it goes to the least-loaded worker.
    unscheduled = IdentityConfig(derive_programs=False)
    gateway = Gateway([WorkerLink("gone", gone.url), WorkerLink("live", live.url)], identity=unscheduled)
    client = await gateway_client(gateway)
    try:
        gone.stop()  # both idle: the least loaded is the first listed, the one gone
        response = await client.post("/v1/chat/completions", json=chat(program_id=None, stream=True))
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        assert not gateway.links["gone"].healthy and gateway.links["live"].healthy
    finally:
        await client.aclose()
        await gateway.stop()


async def test_a_connect_timed_out_by_a_blocked_event_loop_goes_again_and_kills_no_worker(start_sim) -> None:
    sim = start_sim("--time-scale", "0", "--served-model-name", MODEL)
    # No connection is reused, so the completion connects anew, after start's health checks.
    gateway = Gateway([WorkerLink("w0", sim.url)], transport=AiohttpTransport(keepalive_s=0), connect_timeout_s=0.2)
    client = await gateway_client(gateway)
    loop = asyncio.get_running_loop()
    connect = loop.create_connection
    blocked: list[float] = []

    async def connect_on_a_blocked_loop(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not blocked:
            # The loop is held up past the connect timeout just as the connect starts: the worker
            # accepts at once, but the timer fires before the loop sees the connection made.
            blocked.append(0.5)
            time.sleep(0.5)
        return await connect(*args, **kwargs)

    loop.create_connection = connect_on_a_blocked_loop  # type: ignore[method-assign]
    try:
        response = await client.post("/v1/chat/completions", json=chat())
        assert blocked and response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 12
        assert gateway.links["w0"].healthy and gateway.worker_state(gateway.links["w0"]) == "ready"
    finally:
        del loop.create_connection
        await client.aclose()
        await gateway.stop()


@contextlib.contextmanager
def accept_queue_full(port: int) -> Iterator[None]:
    """A worker whose accept queue is full on `port`: a socket listening with a backlog of 0 that
    never accepts, the one place in its queue taken; the kernel drops every further connect's SYN."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    fillers = connect_unaccepted(port, 2)
    try:
        wait_for(lambda: accept_queue(port) == 1, 10, "the filler in the accept queue")
        yield
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


# A program whose hash home is the worker listed first: a new program goes to its home, as an
# unscheduled request goes to the first listed of equally loaded workers.
HOMED_FIRST = next(f"p{i}" for i in range(100) if home(f"p{i}", ["full", "other"]) == "full")


@pytest.mark.parametrize("program_id", [HOMED_FIRST, None], ids=["scheduled", "unscheduled"])
@pytest.mark.slow
async def test_a_connect_to_a_worker_with_a_full_accept_queue_times_out_and_the_other_worker_serves(
    start_sim, caplog, program_id
) -> None:
    full, other = (start_sim("--time-scale", "0", "--served-model-name", MODEL) for _ in range(2))
    identity = IdentityConfig(derive_programs=program_id is not None)
    links = [WorkerLink("full", full.url), WorkerLink("other", other.url)]
    gateway = Gateway(links, transport=AiohttpTransport(keepalive_s=0), connect_timeout_s=0.3, identity=identity)
    client = await gateway_client(gateway)
    full.stop()  # healthy when the gateway started; now its port is a listener that never accepts
    try:
        with accept_queue_full(int(full.url.rsplit(":", 1)[1])):
            response = await client.post("/v1/chat/completions", json=chat(program_id=program_id))
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 12
        again = [r.getMessage() for r in caplog.records if "the request goes again" in r.getMessage()]
        assert len(again) == 1 and again[0].startswith("worker full failed (ConnectTimeout"), again
        if program_id is not None:
            assert gateway.scheduler.programs[program_id].worker == "other"
        # No verdict on the worker from a connect timeout: its health polls decide.
        assert gateway.links["full"].healthy and all(u.in_flight == 0 for u in gateway.links.values())
    finally:
        await client.aclose()
        await gateway.stop()


@pytest.fixture
async def silent_server(anyio_backend: str) -> AsyncIterator[str]:
    """Accepts connections and never answers (a stalled worker)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture
async def one_answer_per_connection(anyio_backend: str) -> AsyncIterator[str]:
    """Answers the first request on a connection with keep-alive, then closes it when the next one
    arrives, as a worker does whose keep-alive ran out just as the gateway reused the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):  # the client may close it first
            await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def test_a_connection_closed_as_it_is_reused_is_retried_on_another(one_answer_per_connection: str) -> None:
    async with httpx.AsyncClient(transport=AiohttpTransport(keepalive_s=4.0)) as client:
        for _ in range(3):
            response = await client.post(f"{one_answer_per_connection}/v1/completions", content=b"{}")
            assert response.status_code == 200 and response.text == "ok"


async def test_a_silent_worker_is_a_read_timeout_and_a_closed_port_a_connect_error(silent_server: str) -> None:
    async with httpx.AsyncClient(transport=AiohttpTransport(keepalive_s=4.0)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(f"{silent_server}/health", timeout=httpx.Timeout(None, read=0.3))
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{pick_free_port()}/health")
