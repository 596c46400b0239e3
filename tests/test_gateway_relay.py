"""The gateway's relay in-process: the app through httpx's ASGITransport, the workers the simulated
engine's app (vLLM's API) through another, or, for the faults, an httpx MockTransport. Relay,
failover to another worker and the SSE usage rewrite, with the engine's usage accounted to the
program. tests/test_gateway_vllm.py does the same over real vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn

from support import relays_apart, short_socket_dir
from thunderctl.engines.simulated.server import SimEngineConfig, SimServer
from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.admissions import Admission, Admitted, AnswerEnd, Chain, Failure
from thunderctl.gateway.apis import CHAT
from thunderctl.gateway.identity import Candidates, ChatKeys, Claim, Keys, Match, PromptKeys, PromptMatches
from thunderctl.gateway.relay import Relay
from thunderctl.gateway.remote import AdmissionsServer, RemoteAdmissions
from thunderctl.gateway.requests import PromptShape
from thunderctl.gateway.views import programs_view
from thunderctl.prometheus import parse_samples

pytestmark = pytest.mark.anyio

METRICS = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",engine="0"} 1.0\n'
USAGE = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
CONTENT_CHUNK = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "ok"}}]}
USAGE_CHUNK = {"id": "c1", "choices": [], "usage": USAGE}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"


@dataclass
class Workers:
    """vLLM workers behind a MockTransport, by host name. `dead` ones refuse connections to
    their completion routes (health and metrics, asked at start, still answer); `fail_next`
    refuses the next completion request whichever worker it goes to; `time_out_next` times the
    next one's connect out."""

    stream_body: bytes = field(default_factory=lambda: sse(CONTENT_CHUNK, USAGE_CHUNK))
    dead: set[str] = field(default_factory=set)
    fail_next: int = 0
    time_out_next: int = 0
    status: int = 200
    attempts: list[str] = field(default_factory=list)  # worker of every completion request
    bodies: list[dict] = field(default_factory=list)  # what the ones answered were sent
    sent: list[bytes] = field(default_factory=list)  # the same, as bytes

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        worker = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        self.attempts.append(worker)
        if worker in self.dead or self.fail_next:
            self.fail_next = max(0, self.fail_next - 1)
            raise httpx.ConnectError("connection refused", request=request)
        if self.time_out_next:
            self.time_out_next -= 1
            raise httpx.ConnectTimeout("connect timed out", request=request)
        body = json.loads(request.content)
        self.bodies.append(body)
        self.sent.append(request.content)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "max_tokens is too large"}})
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream_body)
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}], "usage": USAGE}
        return httpx.Response(200, json=reply)


class SimEngine(httpx.ASGITransport):
    """The simulated engine's app in-process, stepping as fast as it can, for every worker; the
    completion bodies it was sent are kept."""

    def __init__(self) -> None:
        self.server = SimServer(SimEngineConfig(port=0, time_scale=0))
        super().__init__(app=self.server.app())
        self.bodies: list[dict] = []
        self.answers: list[str] = []  # what it answered them

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not (request.url.path.startswith("/v1/") and request.method == "POST"):
            return await super().handle_async_request(request)
        self.bodies.append(json.loads(await request.aread()))
        response = await super().handle_async_request(request)
        self.answers.append((await response.aread()).decode())
        return httpx.Response(response.status_code, headers=response.headers, content=self.answers[-1].encode())


@pytest.fixture
async def engine(anyio_backend: str) -> AsyncIterator[SimEngine]:
    engine = SimEngine()
    steps = asyncio.create_task(engine.server.runner.run())
    yield engine
    steps.cancel()
    await asyncio.gather(steps, return_exceptions=True)


@pytest.fixture(params=[1, 2], ids=["one-process", "two-relays"])
async def gateway_over(
    anyio_backend: str, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[..., Awaitable[tuple[httpx.AsyncClient, Gateway]]]]:
    """The gateway's app over the given workers (a, b, ... as http://a:8000 ...), spoken to
    in-process: the one process's, or two relays' taking requests in turn, over the scheduler's
    messages on a real Unix socket. Its loops stop at the end."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(
            workers: Workers | SimEngine, names: tuple[str, ...] = ("a", "b")
        ) -> tuple[httpx.AsyncClient, Gateway]:
            links = [WorkerLink(name, f"http://{name}:8000") for name in names]
            gateway = Gateway(links, transport=workers if isinstance(workers, SimEngine) else workers.transport())
            assert await gateway.start() == []
            stack.push_async_callback(gateway.stop)
            app = build_app(gateway)
            if request.param > 1:
                app = await stack.enter_async_context(relays_apart(gateway, request.param, app))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
            stack.push_async_callback(client.aclose)
            return client, gateway

        yield make


def chat(program_id: str | None = "p1", **extra: object) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "list the files"}], "max_tokens": 8}
    return body | ({"program_id": program_id} if program_id else {}) | extra


def program(gateway: Gateway, program_id: str) -> dict:
    return next(p for p in programs_view(gateway) if p["program_id"] == program_id)


async def test_a_reply_is_relayed_as_is_and_its_usage_accounted(gateway_over, engine) -> None:
    client, gateway = await gateway_over(engine)
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.text == engine.answers[0]
    assert "program_id" not in engine.bodies[0]  # the engine never sees the field
    assert engine.bodies[0]["messages"] == chat()["messages"]
    seen = program(gateway, "p1")
    assert (seen["tokens"], seen["steps"], seen["phase"]) == (response.json()["usage"]["total_tokens"], 1, "acting")
    assert all(u.in_flight == 0 for u in gateway.links.values())


async def test_a_body_the_gateway_does_not_edit_reaches_the_worker_as_the_client_sent_it(gateway_over) -> None:
    workers = Workers()
    client, _ = await gateway_over(workers)
    body = '{"model": "tiny",  "messages": [{"role": "user", "content": "répertoire \\u00e9"}], "max_tokens": 8}'
    assert (await client.post("/v1/chat/completions", content=body.encode())).status_code == 200
    assert workers.sent == [body.encode()]


async def test_a_streamed_body_reaches_the_worker_as_sent_with_the_usage_request_added(gateway_over) -> None:
    workers = Workers()
    client, _ = await gateway_over(workers)
    body = b'{"model":"tiny","messages":[{"role":"user","content":"ls"}],"stream":true}\n'
    assert (await client.post("/v1/chat/completions", content=body)).status_code == 200
    assert workers.sent == [b'{"model":"tiny","messages":[{"role":"user","content":"ls"}],"stream":true,'
                            b'"stream_options":{"include_usage":true}}']  # fmt: skip


async def test_a_utf16_body_reaches_the_worker_encoded_again(gateway_over) -> None:
    workers = Workers()
    client, _ = await gateway_over(workers)
    body = chat(None, stream=True)
    assert (await client.post("/v1/chat/completions", content=json.dumps(body).encode("utf-16"))).status_code == 200
    assert json.loads(workers.sent[0].decode("utf-8")) == body | {"stream_options": {"include_usage": True}}


async def test_an_engine_error_is_relayed_with_its_status_and_not_retried(gateway_over) -> None:
    workers = Workers(status=400)
    client, gateway = await gateway_over(workers)
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]
    assert len(workers.attempts) == 1
    seen = program(gateway, "p1")  # no usage: no step, the size stays the gateway's estimate
    assert seen["steps"] == 0 and seen["phase"] == "acting" and seen["tokens"] != USAGE["total_tokens"]
    assert all(u.healthy for u in gateway.links.values())


async def test_a_worker_that_refuses_is_failed_over_once_to_another(gateway_over) -> None:
    workers = Workers(fail_next=1)
    client, gateway = await gateway_over(workers)
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200 and response.json()["usage"] == USAGE

    refused, served = workers.attempts
    assert refused != served
    assert not gateway.links[refused].healthy and gateway.links[served].healthy
    seen = program(gateway, "p1")
    assert seen["backend"] == served and seen["tokens"] == USAGE["total_tokens"] and seen["steps"] == 1
    assert all(u.in_flight == 0 for u in gateway.links.values())

    # The program's next request goes to the worker that answered, at once.
    assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
    assert workers.attempts[2:] == [served]


async def test_a_connect_timeout_goes_again_and_leaves_the_worker_in_service(gateway_over) -> None:
    workers = Workers(time_out_next=1)
    client, gateway = await gateway_over(workers, names=("a",))
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200 and response.json()["usage"] == USAGE
    assert workers.attempts == ["a", "a"]
    assert gateway.links["a"].healthy and gateway.worker_state(gateway.links["a"]) == "ready"
    assert program(gateway, "p1")["steps"] == 1


async def test_no_second_retry_when_the_other_worker_refuses_too(gateway_over) -> None:
    workers = Workers(dead={"a", "b", "c"})
    client, gateway = await gateway_over(workers, names=("a", "b", "c"))
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "backend_error" and f"backend {workers.attempts[-1]}" in error["message"]
    assert len(workers.attempts) == 2 and len(set(workers.attempts)) == 2
    assert all(u.in_flight == 0 for u in gateway.links.values())


async def test_the_only_worker_refusing_is_a_502_without_a_retry(gateway_over) -> None:
    workers = Workers(dead={"a"})
    client, _ = await gateway_over(workers, names=("a",))
    response = await client.post("/v1/chat/completions", json=chat(program_id=None))
    assert response.status_code == 502 and "http://a:8000" in response.json()["error"]["message"]
    assert workers.attempts == ["a"]


def usage_event(stream: str) -> str:
    """The engine's usage-only event (no choices), as sent."""
    return next(event + "\n\n" for event in stream.split("\n\n") if '"choices":[]' in event)


def total_tokens(event: str) -> int:
    return json.loads(event.removeprefix("data: "))["usage"]["total_tokens"]


async def test_stream_asks_for_usage_and_drops_the_chunk_the_client_did_not_ask_for(gateway_over, engine) -> None:
    client, gateway = await gateway_over(engine)
    response = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert engine.bodies[0]["stream_options"] == {"include_usage": True}
    # The content chunks as the engine sent them; its usage-only chunk (and that event's blank line) gone.
    usage = usage_event(engine.answers[0])
    assert response.text == engine.answers[0].replace(usage, "") != engine.answers[0]
    assert program(gateway, "p1")["tokens"] == total_tokens(usage)
    assert all(u.in_flight == 0 for u in gateway.links.values())


async def test_stream_keeps_the_usage_chunk_a_client_asked_for(gateway_over, engine) -> None:
    client, gateway = await gateway_over(engine)
    options = {"include_usage": True, "continuous_usage_stats": False}
    response = await client.post("/v1/chat/completions", json=chat(stream=True, stream_options=options))
    assert engine.bodies[0]["stream_options"] == options
    assert response.text == engine.answers[0]
    assert program(gateway, "p1")["tokens"] == total_tokens(usage_event(engine.answers[0]))


async def test_stream_strips_usage_riding_on_a_content_chunk_the_client_did_not_ask_for(gateway_over) -> None:
    workers = Workers(stream_body=sse(CONTENT_CHUNK | {"usage": USAGE}))
    client, gateway = await gateway_over(workers)
    response = await client.post("/v1/chat/completions", json=chat(stream=True))
    events = [line for line in response.text.split("\n") if line]
    assert events == [f"data: {json.dumps(CONTENT_CHUNK, separators=(',', ':'))}", "data: [DONE]"]
    assert program(gateway, "p1")["tokens"] == USAGE["total_tokens"]


async def test_a_stream_without_usage_counts_as_a_failed_request(gateway_over) -> None:
    workers = Workers(stream_body=sse(CONTENT_CHUNK))  # an engine that ignored include_usage
    client, gateway = await gateway_over(workers)
    response = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert response.status_code == 200 and response.text == workers.stream_body.decode()
    seen = program(gateway, "p1")  # ended as a failed request: acting, no step, no engine count
    assert seen["steps"] == 0 and seen["phase"] == "acting" and seen["tokens"] != USAGE["total_tokens"]
    assert all(u.in_flight == 0 for u in gateway.links.values())


async def counted_once(gateway: Gateway) -> None:
    while gateway.client_disconnects == 0:
        await asyncio.sleep(0.01)


async def cut_mid_body(app: object, gateway: Gateway) -> None:
    """A client that sends half a request's body to `app`, over real HTTP, and goes away; returns
    once `gateway` has counted it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()  # raises why it stopped
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)  # the body never all comes
        writer.write(b'POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000\r\n\r\n{"mod')
        await writer.drain()
        writer.close()
        await asyncio.wait_for(counted_once(gateway), timeout=10)
    finally:
        server.should_exit = True
        await serving


def disconnects_counted(metrics: str) -> list[float]:
    return [sample.value for sample in parse_samples(metrics, {"thunderctl_client_disconnects_total"})]


async def test_a_client_gone_mid_body_is_counted_and_logged_in_one_line(gateway_over, caplog) -> None:
    client, gateway = await gateway_over(Workers())
    caplog.set_level(logging.INFO)
    await cut_mid_body(build_app(gateway), gateway)
    assert disconnects_counted((await client.get("/metrics")).text) == [1.0]
    lines = [r.getMessage() for r in caplog.records if r.name == "thunderctl.gateway.disconnects"]
    assert lines == ["client went away mid-body: POST /v1/chat/completions (1 so far)"]
    assert not [r for r in caplog.records if r.exc_info]  # no traceback, from uvicorn or anyone


async def test_a_worker_started_again_gets_no_request_until_its_new_engine_answers(gateway_over, engine) -> None:
    client, gateway = await gateway_over(engine)
    gateway.restarting("a")  # what the daemon says once it has started a dead worker's process again
    assert gateway.worker_state(gateway.links["a"]) == "starting"
    for index in range(4):
        response = await client.post("/v1/chat/completions", json=chat(f"p{index}"))
        assert response.status_code == 200 and program(gateway, f"p{index}")["backend"] == "b"
    await gateway.refresh_metrics()  # its engine answers again
    assert gateway.worker_state(gateway.links["a"]) == "ready"


@dataclass
class Told:
    """The scheduler side as a relay sees it (admissions.py), recording every message: it admits to
    worker a, or to b when a just failed the request, and asks a failed request to go again once."""

    messages: list[object] = field(default_factory=list)
    keeps_answers: bool = False
    remote: bool = False
    derives: bool = True

    async def claim(self, keys: Keys, matches: PromptMatches) -> Claim | None:
        self.messages.append(keys)
        return Claim("conv-1", Match.NEW, "first-1")

    async def candidates(self, keys: PromptKeys) -> Candidates:
        self.messages.append(keys)
        return Candidates()

    async def chain(self, response_id: str) -> Chain | None:
        return None

    async def admit(self, admission: Admission) -> Admitted:
        self.messages.append(admission)
        worker = "b" if admission.avoid == "a" else "a"
        return Admitted(worker, f"http://{worker}:8000")

    def finished(self, end: AnswerEnd) -> None:
        self.messages.append(end)

    async def failed(self, failure: Failure) -> bool:
        self.messages.append(failure)
        return failure.attempt == 1

    async def ended(self, end: AnswerEnd, keep: bool) -> None:
        self.messages.append(("ended", end, keep))

    async def route(self, program_id: str | None) -> Admitted:
        return Admitted("a", "http://a:8000")


async def relayed_through(told: Told, workers: Workers, body: dict, derived: bool = False) -> bytes:
    """One request through a relay whose scheduler side is `told` (of program p1, or `derived` from
    its conversation); the answer's bytes."""
    transport = workers.transport()
    async with httpx.AsyncClient(transport=transport) as client:
        relay = Relay(told, client, transport, clock=lambda: 0.0)
        followed = await relay.follow(CHAT.turn(body)) if derived else None
        program_id = followed.program_id if followed is not None else "p1"
        shape = PromptShape(chars=14)
        relayed = await relay.relay(CHAT, "/v1/chat/completions", body, program_id, shape, followed)
        if isinstance(relayed.body, bytes):
            return relayed.body
        return b"".join([chunk async for chunk in relayed.body])


async def test_a_relay_tells_the_scheduler_side_a_streamed_answers_usage_and_first_token_time_as_it_ends() -> None:
    told = Told()
    answer = await relayed_through(told, Workers(), chat(stream=True))
    assert answer.endswith(b"data: [DONE]\n\n")
    admission, end = told.messages
    assert isinstance(admission, Admission) and (admission.program_id, admission.attempt) == ("p1", 1)
    assert isinstance(end, AnswerEnd) and (end.worker, end.program_id, end.usage) == ("a", "p1", USAGE)
    assert end.ttft_s is not None


async def test_a_relay_process_tells_a_streamed_answers_end_and_waits_for_it_in_one_message() -> None:
    told = Told(remote=True)
    answer = await relayed_through(told, Workers(), chat(stream=True))
    assert answer.endswith(b"data: [DONE]\n\n")
    admission, (kind, end, keep) = told.messages
    assert isinstance(admission, Admission) and kind == "ended" and keep is False
    assert isinstance(end, AnswerEnd) and (end.program_id, end.usage) == ("p1", USAGE)


async def test_a_derived_programs_scheduler_side_is_told_hashes_and_never_the_conversations_text() -> None:
    told = Told()
    body = chat(stream=True)
    body["messages"] = [{"role": "user", "content": "fix the parser in répertoire/secret_module.py"}]
    await relayed_through(told, Workers(), body, derived=True)
    keys, admission, end = told.messages
    assert isinstance(keys, ChatKeys) and isinstance(admission, Admission) and admission.program_id == "conv-1"
    assert isinstance(end, AnswerEnd) and end.conversation is not None  # what its next turn is found by
    assert "secret_module" not in repr(told.messages)


async def test_a_relay_tells_a_refused_connection_and_asks_again_away_from_that_worker() -> None:
    told = Told()
    await relayed_through(told, Workers(dead={"a"}), chat())
    admission, failure, again, end = told.messages
    assert failure == Failure("a", "p1", worker_down=True, attempt=1)
    assert isinstance(again, Admission) and (again.avoid, again.attempt) == ("a", 2)
    assert isinstance(end, AnswerEnd) and (end.worker, end.usage) == ("b", USAGE)


async def test_a_request_the_scheduler_fails_on_is_served_unscheduled_and_the_next_is_scheduled(
    anyio_backend: str, caplog
) -> None:
    workers = Workers()
    gateway = Gateway([WorkerLink("a", "http://a:8000")], transport=workers.transport())
    assert await gateway.start() == []
    admit = gateway.admit
    raised: list[str] = []

    async def fails_once(admission: Admission) -> Admitted:
        if not raised:
            raised.append(admission.program_id or "")
            raise RuntimeError("a bug in the scheduler")
        return await admit(admission)

    gateway.admit = fails_once  # type: ignore[method-assign]
    try:
        async with relays_apart(gateway, 2, build_app(gateway)) as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
                async with asyncio.timeout(10):  # with no answer to the failed call, it would hang
                    first = await client.post("/v1/chat/completions", json=chat("p1"))
                    second = await client.post("/v1/chat/completions", json=chat("p2"))
    finally:
        await gateway.stop()
    assert raised == ["p1"] and first.status_code == 200 and second.status_code == 200
    assert workers.attempts == ["a", "a"]
    assert "p1" not in {p["program_id"] for p in programs_view(gateway)}  # served, not scheduled
    assert program(gateway, "p2")["steps"] == 1
    assert "a bug in the scheduler" in caplog.text


async def test_a_client_gone_mid_body_at_a_relay_process_is_counted_in_the_daemons_metrics(anyio_backend: str) -> None:
    gateway = Gateway([WorkerLink("a", "http://a:8000")], transport=Workers().transport())
    assert await gateway.start() == []
    try:
        async with relays_apart(gateway, 2, build_app(gateway)) as app:
            await cut_mid_body(app, gateway)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
                metrics = (await client.get("/metrics")).text
    finally:
        await gateway.stop()
    assert disconnects_counted(metrics) == [1.0]


async def test_an_answer_admitted_before_the_daemon_restarted_does_not_end_one_the_next_daemon_admitted(
    anyio_backend: str,
) -> None:
    socket_dir = short_socket_dir()
    daemons = [Gateway([WorkerLink("a", "http://a:8000")], transport=Workers().transport()) for _ in range(2)]
    for daemon in daemons:
        assert await daemon.start() == []
    server = AdmissionsServer(daemons[0], socket_dir / "relays.sock", release=lambda program_id: None)
    await server.start()
    remote = RemoteAdmissions(server.path, 1, [("a", "http://a:8000")], on_give_up=lambda worker: 0)
    await remote.start()
    shape = PromptShape(chars=14)
    try:
        before = await remote.admit(Admission("p1", shape))
        await server.stop()  # the daemon dies; the next one starts on the same socket
        server = AdmissionsServer(daemons[1], server.path, release=lambda program_id: None)
        await server.start()
        await remote.admit(Admission("p2", shape))
        remote.finished(AnswerEnd("a", "p1", shape, USAGE, ticket=before.ticket))
        await remote.chain("resp-1")  # a call after the end: the daemon has read the end by its reply
        in_flight = daemons[1].links["a"].in_flight
    finally:
        await remote.stop()
        await server.stop()
        for daemon in daemons:
            await daemon.stop()
        socket_dir.rmdir()
    assert in_flight == 1  # p2's answer still runs there
    assert program(daemons[1], "p2")["steps"] == 0 and "p1" not in {p["program_id"] for p in programs_view(daemons[1])}
