"""Bad input gets a 4xx that names what is wrong, on every API: body size and JSON depth, program
ids, the types of the fields thunderctl acts on; then over a thousand generated malformed
requests (a tenth of them in the fast tier) against the gateway (real HTTP), the sandbox routes
and the control API, with no 5xx, no dropped connection, and the gateway still serving afterwards."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.testclient import TestClient

from thunderctl.daemon.control import build_control_app
from thunderctl.gateway.apis import GENERATION_ROUTES
from thunderctl.gateway.routes import RELAYED_ROUTES
from thunderctl.jsonapi import MAX_PROGRAM_ID_CHARS, BodyLimits, nesting_depth
from thunderctl.sandbox import sandbox_routes

KEY = "bounds-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SMALL_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


# ---- one at a time, in-process ----------------------------------------------------------


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_a_413_by_its_length_or_as_it_streams(gateway_app) -> None:
    client, _ = await gateway_app(limits=BodyLimits(max_bytes=4096))
    padded = json.dumps(CHAT | {"pad": "x" * 5000}).encode()
    declared = await client.post("/v1/chat/completions", content=padded)
    assert declared.status_code == 413 and "gateway.max_body_bytes" in message(declared)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        for start in range(0, len(padded), 1000):
            yield padded[start : start + 1000]

    streamed = await client.post("/v1/chat/completions", content=chunks())
    assert streamed.status_code == 413 and "4096" in message(streamed)
    assert (
        await client.post("/programs/release", content=b'{"program_id": "' + b"p" * 5000 + b'"}')
    ).status_code == 413
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.anyio
async def test_json_nested_too_deep_is_a_400_not_a_crash(gateway_app) -> None:
    client, _ = await gateway_app()
    for depth in (64, 5000, 100_000):  # inside the body object: 65 levels and more
        body = '{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "x": ' + nested(depth) + "}"
        for path in ("/v1/chat/completions", "/programs/release"):
            response = await client.post(path, content=body)
            assert response.status_code == 400, (depth, path)
            assert "deeper than 64" in message(response)
    deepest_allowed = json.dumps(CHAT)[:-1] + ', "x": ' + nested(63) + "}"  # the body object is level 1
    assert nesting_depth(json.loads(deepest_allowed)) == 64
    assert (await client.post("/v1/chat/completions", content=deepest_allowed)).status_code == 200


@pytest.mark.anyio
async def test_an_integer_too_long_to_read_is_a_400(gateway_app) -> None:
    client, _ = await gateway_app()
    response = await client.post("/v1/chat/completions", content='{"max_tokens": ' + "9" * 5000 + "}")
    assert response.status_code == 400 and "not valid JSON" in message(response)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("where", "request_parts"),
    [
        ("program_id", lambda pid: {"json": CHAT | {"program_id": pid}}),
        ("extra_body.program_id", lambda pid: {"json": CHAT | {"extra_body": {"program_id": pid}}}),
        ("x-program-id header", lambda pid: {"json": CHAT, "headers": {"X-Program-Id": pid}}),
        ("x-dynamo-session-id header", lambda pid: {"json": CHAT, "headers": {"x-dynamo-session-id": pid}}),
    ],
)
async def test_program_ids_are_at_most_256_printable_characters(gateway_app, where, request_parts) -> None:
    client, _ = await gateway_app()
    for bad in ("p" * (MAX_PROGRAM_ID_CHARS + 1), "p" * 100_000, "line\nbreak", "tab\there", "nul\x00"):
        if where.endswith("header") and not bad.isascii() or "\n" in bad and where.endswith("header"):
            continue  # not a header value a client can send
        response = await client.post("/v1/chat/completions", **request_parts(bad))
        assert response.status_code == 400, (where, bad[:20])
        assert where.split()[0] in message(response).lower()
    longest = "p" * MAX_PROGRAM_ID_CHARS
    assert (await client.post("/v1/chat/completions", **request_parts(longest))).status_code == 200
    assert [p["program_id"] for p in (await client.get("/programs")).json()["programs"]] == [longest]


@pytest.mark.anyio
async def test_release_checks_its_program_id(gateway_app) -> None:
    client, _ = await gateway_app()
    for body in ({}, {"program_id": ""}, {"program_id": True}, {"program_id": ["p"]}, {"program_id": "p" * 257}):
        response = await client.post("/programs/release", json=body)
        assert response.status_code == 400 and "program_id" in message(response), body
    assert (await client.post("/programs/release", json={"program_id": 7})).json() == {
        "program_id": "7",
        "released": False,
    }


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"), ("stream", 1), ("stream", []),
        ("stream_options", 5), ("stream_options", "x"), ("stream_options", [True]),
        ("stream_options.include_usage", "yes"), ("stream_options.include_usage", {}),
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5), ("max_tokens", "16"), ("max_tokens", True),
        ("max_completion_tokens", "many"),
        ("docker_ids", "c1"), ("docker_ids", [1]), ("docker_ids", [""]), ("docker_ids", ["c" * 300]),
        ("messages", []), ("messages", "hi"),
    ],
)  # fmt: skip
async def test_fields_the_gateway_acts_on_have_their_openai_types(gateway_app, field, value) -> None:
    client, worker = await gateway_app()
    body = dict(CHAT)
    if field == "stream_options.include_usage":
        body["stream"], body["stream_options"] = True, {"include_usage": value}
    else:
        body[field] = value
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and field in message(response), response.text
    assert worker.authorizations == []  # nothing reached the engine


@pytest.mark.anyio
async def test_sandbox_bodies_are_strict_and_refused_before_the_pool(unreached_pool) -> None:
    app = Starlette(routes=sandbox_routes(unreached_pool))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sb") as client:
        cases = [
            ("/v1/sandboxes", {"program_id": "p", "image": 7}, "image"),
            ("/v1/sandboxes", {"program_id": "p", "image": ""}, "image"),
            ("/v1/sandboxes", {"program_id": "p", "image": "two words"}, "image"),
            ("/v1/sandboxes", {"program_id": "p" * 257}, "program_id"),
            ("/v1/sandboxes", {"program_id": True}, "program_id"),
            ("/v1/sandboxes", {"program_id": "p", "env": {"A": 1}}, "env"),
            ("/v1/sandboxes", {"program_id": "p", "env": {"A=B": "1"}}, "env"),
            ("/v1/sandboxes", {"program_id": "p", "setup": ["ls"]}, "setup"),
            ("/v1/sandboxes", {"program_id": "p", "imgae": "typo"}, "imgae"),
            ("/v1/sandboxes/adopt", {"program_id": "p", "docker_ids": [""]}, "docker_ids"),
            ("/v1/sandboxes/adopt", {"program_id": "p", "docker_ids": "abc"}, "docker_ids"),
            ("/v1/sandboxes/adopt", {"program_id": "\x01", "docker_ids": ["abc"]}, "program_id"),
            ("/v1/sandboxes/sb-1/exec", {"cmd": []}, "cmd"),
            ("/v1/sandboxes/sb-1/exec", {"cmd": 5}, "cmd"),
            ("/v1/sandboxes/sb-1/exec", {"cmd": ["ls", 5]}, "cmd"),
            ("/v1/sandboxes/sb-1/exec", {"cmd": "a\x00b"}, "cmd"),
            ("/v1/sandboxes/sb-1/exec", {"cmd": "ls", "timeout": "5"}, "timeout"),
            ("/v1/sandboxes/sb-1/exec", {"cmd": "ls", "timeout": -1}, "timeout"),
        ]
        for path, body, field in cases:
            response = await client.post(path, json=body)
            assert response.status_code == 400 and field in message(response), (body, response.text)
        infinite = await client.post("/v1/sandboxes/sb-1/exec", content=b'{"cmd": "ls", "timeout": Infinity}')
        assert infinite.status_code == 400 and "timeout" in message(infinite)
        for raw in ("nan", "inf", "soon", "-inf"):
            waited = await client.get(f"/v1/sandboxes/sb-1?wait=ready&timeout={raw}")
            assert waited.status_code == 400 and "timeout" in message(waited), raw
        listed = await client.get("/v1/sandboxes", params={"program_id": "p" * 300})
        assert listed.status_code == 400 and "program_id" in message(listed)
        # A well-formed request does reach the pool, which says it has no Docker engine.
        assert (await client.post("/v1/sandboxes", json={"program_id": "p"})).status_code == 503


@pytest.mark.anyio
async def test_control_numbers_are_checked_before_anything_is_drained(daemon_of) -> None:
    daemon = daemon_of()
    await daemon.gateway.start()
    try:
        app = build_control_app(daemon)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://control") as control:
            for raw in (
                '{"timeout": "abc"}',
                '{"timeout": true}',
                '{"timeout": -1}',
                '{"timeout": NaN}',
                '{"timeout": Infinity}',
                '{"timeout": 1e12}',
                '{"timeout": null}',
                "[1]",
                "{bad",
            ):
                response = await control.post("/shutdown", content=raw)
                assert response.status_code == 400, raw
                assert "timeout" in message(response) or "JSON" in message(response)
            assert (await control.post("/drain", json={"target": 5})).status_code == 400
        assert not any(u.draining for u in daemon.gateway.links.values())
    finally:
        await daemon.gateway.stop()


STREAMED_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 64 * 1024
GATEWAY_SERVER = ("127.0.0.1", 8300)  # the daemon's app serves its control API where a socket has no port
CONTROL_SERVER = None


async def bytes_read_before_the_answer(app, server: tuple[str, int] | None, path: str) -> tuple[int, int]:
    """POSTs 64 MiB to `path`, chunked (no Content-Length), straight into the ASGI app, one
    chunk object handed out again and again (the test holds 64 KiB, not 64 MiB); returns the
    answer's status and how many bytes the app had taken from the stream when it answered."""
    taken, answered = 0, []
    chunk = b" " * CHUNK_BYTES

    async def receive() -> dict:
        nonlocal taken
        if taken >= STREAMED_BYTES:
            return {"type": "http.disconnect"}
        taken += CHUNK_BYTES
        return {"type": "http.request", "body": chunk, "more_body": taken < STREAMED_BYTES}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answered.append((message["status"], taken))

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 50000), "server": server,
    }  # fmt: skip
    await app(scope, receive, send)
    return answered[0]


# Every route that reads a body: the generation APIs, the engines' routes relayed with theirs, and
# the gateway's and the control socket's own.
BODY_ROUTES = [
    *((GATEWAY_SERVER, path) for path in GENERATION_ROUTES),
    *((GATEWAY_SERVER, route.path) for route in RELAYED_ROUTES if route.method == "POST"),
    (GATEWAY_SERVER, "/programs/release"), (GATEWAY_SERVER, "/admin/pause"), (GATEWAY_SERVER, "/admin/resume"),
    (CONTROL_SERVER, "/drain"), (CONTROL_SERVER, "/undrain"), (CONTROL_SERVER, "/workers/stop"),
    (CONTROL_SERVER, "/shutdown"),
]  # fmt: skip
SANDBOX_BODY_ROUTES = ["/v1/sandboxes", "/v1/sandboxes/adopt", "/v1/sandboxes/sb-1/exec"]


@pytest.mark.anyio
@pytest.mark.parametrize(("server", "path"), BODY_ROUTES, ids=[path for _, path in BODY_ROUTES])
async def test_every_daemon_route_stops_reading_a_body_at_the_bound(daemon_of, server, path) -> None:
    daemon = daemon_of(max_body_bytes=SMALL_LIMIT)
    status, taken = await bytes_read_before_the_answer(daemon.app, server, path)
    assert status == 413
    assert taken <= SMALL_LIMIT + CHUNK_BYTES  # not the 64 MiB sent
    assert not daemon.stopping and not any(link.draining for link in daemon.gateway.links.values())


@pytest.mark.anyio
@pytest.mark.parametrize("path", SANDBOX_BODY_ROUTES)
async def test_every_sandbox_route_stops_reading_a_body_at_the_bound(unreached_pool, path) -> None:
    app = Starlette(routes=sandbox_routes(unreached_pool, BodyLimits(max_bytes=SMALL_LIMIT)))
    status, taken = await bytes_read_before_the_answer(app, GATEWAY_SERVER, path)
    assert status == 413 and taken <= SMALL_LIMIT + CHUNK_BYTES


# ---- generated malformed requests ---------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    method: str
    path: str
    content: bytes
    names: str  # what the error message must mention ("" for a body that is not even JSON)
    headers: tuple[tuple[str, str], ...] = ()


scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
not_bool = values.filter(lambda v: not isinstance(v, bool | None))
not_object = values.filter(lambda v: not isinstance(v, dict | None))
bad_program_id = st.one_of(
    st.text(min_size=MAX_PROGRAM_ID_CHARS + 1, max_size=MAX_PROGRAM_ID_CHARS + 40),
    st.text(min_size=1, max_size=20).filter(lambda t: not t.isprintable()),
    st.integers(min_value=10**MAX_PROGRAM_ID_CHARS, max_value=10**300),
    st.booleans(), st.floats(), st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=3), scalars, max_size=2),
)  # fmt: skip
bad_count = st.one_of(
    st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=5), st.lists(scalars, max_size=2)
)
bad_docker_ids = not_object.filter(lambda v: not isinstance(v, list)) | st.lists(
    st.one_of(st.integers(), st.none(), st.just(""), st.text(min_size=257, max_size=260)), min_size=1, max_size=3
)
bad_prompt = values.filter(
    lambda v: (
        not isinstance(v, str)
        and not (isinstance(v, list) and (all(isinstance(t, int) for t in v) or all(isinstance(t, str) for t in v)))
    )
)


def encode(body: object) -> bytes:
    return json.dumps(body).encode()


def is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


@st.composite
def gateway_requests(draw: st.DrawFn) -> Malformed:
    kind = draw(st.sampled_from(["field", "field", "field", "raw", "deep", "huge", "header", "release"]))
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    base = dict(CHAT) if path.endswith("chat/completions") else {"model": "fake", "prompt": "hi", "max_tokens": 2}
    if kind == "field":
        field, strategy = draw(st.sampled_from([
            ("program_id", bad_program_id), ("extra_body.program_id", bad_program_id), ("stream", not_bool),
            ("stream_options", not_object), ("stream_options.include_usage", not_bool), ("max_tokens", bad_count),
            ("docker_ids", bad_docker_ids), ("messages" if "chat" in path else "prompt", bad_prompt),
        ]))  # fmt: skip
        value = draw(strategy)
        if field == "messages":
            value = draw(st.sampled_from([[], "hi", 5, None, {"role": "user"}]))
        head, _, tail = field.partition(".")
        base[head] = {tail: value} if tail else value
        return Malformed("POST", path, encode(base), field)
    if kind == "raw":
        raw = draw(
            st.binary(max_size=64).filter(lambda b: not is_json_object(b))
            | st.builds(encode, values.filter(lambda v: not isinstance(v, dict)))
        )
        return Malformed("POST", path, raw, "")
    if kind == "deep":
        depth = draw(st.integers(min_value=65, max_value=6000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return Malformed("POST", path, ('{"x":' + opener * depth + "1" + closer * depth + "}").encode(), "deeper")
    if kind == "huge":
        size = draw(st.integers(min_value=SMALL_LIMIT + 1, max_value=4 * SMALL_LIMIT))
        return Malformed("POST", path, encode(base | {"pad": "x" * size}), "max_body_bytes")
    if kind == "header":
        pid = draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=257, max_size=300))
        return Malformed("POST", path, encode(base), "x-program-id", (("X-Program-Id", pid),))
    return Malformed("POST", "/programs/release", encode({"program_id": draw(bad_program_id)}), "program_id")


@st.composite
def sandbox_requests(draw: st.DrawFn) -> Malformed:
    route = draw(st.sampled_from(["create", "adopt", "exec", "wait", "list"]))
    if route == "wait":
        raw = draw(st.sampled_from(["nan", "inf", "-inf", "", "x", "1e999", "5s"]))
        return Malformed("GET", f"/v1/sandboxes/sb-1?wait=ready&timeout={raw}", b"", "timeout")
    if route == "list":
        pid = draw(st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=257, max_size=280))
        return Malformed("GET", f"/v1/sandboxes?program_id={pid}", b"", "program_id")
    if route == "create":
        field, value = draw(st.one_of(
            st.tuples(st.just("program_id"), bad_program_id),
            st.tuples(st.just("image"), not_object.filter(lambda v: not isinstance(v, str)) | st.just("") | st.just("a b")),
            st.tuples(st.just("env"), not_object | st.dictionaries(st.text(max_size=4), not_object, min_size=1, max_size=2)
                      .filter(lambda d: any(not isinstance(v, str) for v in d.values()))),
            st.tuples(st.just("setup"), not_object.filter(lambda v: not isinstance(v, str))),
        ))  # fmt: skip
        body = {"program_id": "p"} | {field: value}
        return Malformed("POST", "/v1/sandboxes", encode(body), field)
    if route == "adopt":
        return Malformed(
            "POST", "/v1/sandboxes/adopt", encode({"program_id": "p", "docker_ids": draw(bad_docker_ids)}), "docker_ids"
        )
    field, value = draw(st.one_of(
        st.tuples(st.just("cmd"), st.one_of(st.just([]), st.just(""), st.integers(), st.booleans(), st.none(),
                                           st.lists(st.integers(), min_size=1, max_size=3))),
        st.tuples(st.just("timeout"), st.one_of(st.text(max_size=4), st.booleans(), st.floats(max_value=0),
                                               st.floats().filter(lambda f: not math.isfinite(f)))),
    ))  # fmt: skip
    body = {"cmd": "ls"} | {field: value}
    return Malformed("POST", "/v1/sandboxes/sb-1/exec", encode(body), field)


@st.composite
def control_requests(draw: st.DrawFn) -> Malformed:
    if draw(st.booleans()):
        timeout = draw(st.one_of(
            st.text(max_size=5), st.booleans(), st.lists(scalars, max_size=2), st.floats(max_value=-0.001),
            st.floats(min_value=86400.001), st.just(math.nan), st.integers(min_value=86401),
        ))  # fmt: skip
        return Malformed("POST", "/shutdown", encode({"timeout": timeout}), "timeout")
    path = draw(st.sampled_from(["/drain", "/undrain", "/workers/stop"]))
    target = draw(values.filter(lambda v: not (isinstance(v, str) and v)))
    return Malformed("POST", path, encode({"target": target}), "target")


def check(case: Malformed, response: httpx.Response, outcomes: Counter) -> None:
    outcomes[response.status_code] += 1
    assert response.status_code in (400, 413), (case, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["code"] == response.status_code
    assert case.names.lower() in error["message"].lower(), (case, error["message"])


def generated(examples: int) -> settings:
    """Reproducible runs (derandomized, no example database left in the tree), no time limit."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# The full thousand's cost is its point, so it is in the slow tier; a tenth of it, the same
# strategies against the same real gateway, keeps the fast tier's coverage of every route.
@pytest.mark.parametrize(
    "gateway_cases",
    [pytest.param(100, id="a-hundred"), pytest.param(1000, marks=pytest.mark.slow, id="a-thousand")],
)
@pytest.mark.slow
def test_malformed_requests_get_4xx_and_the_gateway_still_serves(
    fake_backend, start_gateway, unreached_pool, daemon_of, gateway_cases: int
) -> None:
    sandbox_cases, control_cases = gateway_cases * 3 // 10, gateway_cases // 5
    outcomes: dict[str, Counter] = {"gateway": Counter(), "sandboxes": Counter(), "control": Counter()}
    worker = fake_backend()
    gateway = start_gateway([worker.url], "--max-body-bytes", str(SMALL_LIMIT), api_key=KEY)

    @generated(gateway_cases)
    @given(gateway_requests())
    def against_the_gateway(case: Malformed) -> None:
        try:  # a real server on loopback: a dropped connection shows as a transport error
            response = gateway.http.request(case.method, case.path, content=case.content, headers=dict(case.headers))
        except httpx.TransportError as exc:
            raise AssertionError(f"connection dropped on {case}: {exc!r}") from exc
        check(case, response, outcomes["gateway"])

    against_the_gateway()
    assert (gateway.http.get("/health")).status_code == 200
    good = gateway.http.post("/v1/chat/completions", json=CHAT | {"program_id": "after"})
    assert (
        good.status_code == 200 and good.json()["choices"][0]["message"]["content"].count(" ") == CHAT["max_tokens"] - 1
    )
    assert [p["program_id"] for p in gateway.programs().values()] == ["after"]
    assert worker.authorizations == [None]  # of all of them, only the good request reached the engine

    with TestClient(Starlette(routes=sandbox_routes(unreached_pool)), base_url="http://sb") as sandboxes:

        @generated(sandbox_cases)
        @given(sandbox_requests())
        def against_the_sandboxes(case: Malformed) -> None:
            check(case, sandboxes.request(case.method, case.path, content=case.content), outcomes["sandboxes"])

        against_the_sandboxes()

    daemon = daemon_of()
    with TestClient(build_control_app(daemon), base_url="http://control") as control:

        @generated(control_cases)
        @given(control_requests())
        def against_the_control_api(case: Malformed) -> None:
            check(case, control.request(case.method, case.path, content=case.content), outcomes["control"])

        against_the_control_api()
    assert not any(u.draining or u.stopped for u in daemon.gateway.links.values())

    total = sum(sum(c.values()) for c in outcomes.values())
    assert total >= gateway_cases + sandbox_cases + control_cases, outcomes
    assert outcomes["gateway"][413] > 0 and outcomes["gateway"][400] > gateway_cases * 8 // 10, outcomes
