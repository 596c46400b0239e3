"""Dynamo's session headers: `x-dynamo-session-id` names the program, `x-dynamo-session-final:
true` releases it once that response has gone out, a stream only after its last byte."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.requests import BadRequest, ends_session, pop_program_id
from thunderctl.gateway.views import programs_view

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SESSION = "x-dynamo-session-id"
FINAL = "x-dynamo-session-final"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("body", "headers", "program_id"),
    [
        ({}, {SESSION: "dyn"}, "dyn"),
        ({}, {SESSION: "dyn", "x-program-id": "hdr"}, "hdr"),
        ({"extra_body": {"program_id": "extra"}}, {SESSION: "dyn", "x-program-id": "hdr"}, "extra"),
        ({"program_id": "top", "extra_body": {"program_id": "extra"}}, {SESSION: "dyn", "x-program-id": "hdr"}, "top"),
        ({}, {SESSION: ""}, None),
    ],
)
def test_body_wins_over_extra_body_over_x_program_id_over_the_session_header(body, headers, program_id) -> None:
    assert pop_program_id(body, headers) == program_id


def test_a_bad_session_header_is_refused_even_when_the_body_names_the_program() -> None:
    with pytest.raises(BadRequest, match=f"the {SESSION} header must be 1-256 characters"):
        pop_program_id({"program_id": "p"}, {SESSION: "s" * 257})


@pytest.mark.parametrize(
    ("value", "final"), [(None, False), ("true", True), ("True", True), (" TRUE ", True), ("false", False)]
)
def test_the_final_header_is_true_or_false(value, final) -> None:
    assert ends_session({} if value is None else {FINAL: value}, "p") is final


def test_a_final_header_that_is_neither_or_names_no_program_says_how_to_fix_it() -> None:
    with pytest.raises(BadRequest, match=f"{FINAL} header must be true or false, not 'yes'"):
        ends_session({FINAL: "yes"}, "p")
    with pytest.raises(BadRequest, match="send its id in the x-dynamo-trajectory-id header"):
        ends_session({FINAL: "true"}, None)


async def program_ids(client) -> list[str]:
    return [p["program_id"] for p in (await client.get("/programs")).json()["programs"]]


@pytest.mark.anyio
async def test_a_session_is_one_program_until_its_final_request_releases_it(gateway_app) -> None:
    released: list[str] = []
    client, _ = await gateway_app(on_release=released.append)
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers={SESSION: "run-7"})).status_code == 200
    programs = (await client.get("/programs")).json()["programs"]
    assert [(p["program_id"], p["steps"]) for p in programs] == [("run-7", 2)]
    assert released == []

    last = await client.post("/v1/chat/completions", json=CHAT, headers={SESSION: "run-7", FINAL: "true"})
    assert (
        last.status_code == 200 and last.json()["choices"][0]["message"]["content"].count(" ") == CHAT["max_tokens"] - 1
    )
    assert await program_ids(client) == [] and released == ["run-7"]
    # Released through the same path as POST /programs/release: there is nothing left to release.
    assert (await client.post("/programs/release", json={"program_id": "run-7"})).json()["released"] is False


@pytest.mark.anyio
async def test_the_final_request_releases_the_program_named_in_the_body_and_even_when_refused(gateway_app) -> None:
    released: list[str] = []
    client, _ = await gateway_app(on_release=released.append)
    assert (await client.post("/v1/chat/completions", json=CHAT | {"program_id": "body-id"})).status_code == 200
    refused = await client.post(
        "/v1/chat/completions",
        json=CHAT | {"program_id": "body-id", "max_tokens": 0},
        headers={SESSION: "ignored", FINAL: "true"},
    )
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]
    assert await program_ids(client) == [] and released == ["body-id"]


@pytest.mark.anyio
async def test_a_bad_final_header_is_a_400_and_releases_nothing(gateway_app) -> None:
    released: list[str] = []
    client, _ = await gateway_app(on_release=released.append)
    assert (await client.post("/v1/chat/completions", json=CHAT, headers={SESSION: "s"})).status_code == 200
    for headers in ({SESSION: "s", FINAL: "1"}, {FINAL: "true"}):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 400 and FINAL in response.json()["error"]["message"]
    assert await program_ids(client) == ["s"] and released == []


@pytest.mark.anyio
async def test_a_streamed_final_response_releases_only_after_its_last_byte(fake_backend) -> None:
    """Driven as a server drives the app, so each message sent to the client is seen as it goes."""
    worker = fake_backend()
    gateway = Gateway([WorkerLink("fake", worker.url)])
    await gateway.start()
    events: list[tuple[str, Any]] = []

    def known() -> bool:
        return any(p["program_id"] == "stream-1" for p in programs_view(gateway))

    app = build_app(gateway, on_release=lambda pid: events.append(("released", pid)))
    payload = json.dumps(CHAT | {"stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                    (SESSION.encode(), b"stream-1"), (FINAL.encode(), b"true")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8300),
    }  # fmt: skip
    requests = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await gateway_done.wait()  # the client never goes away
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            events.append(("body", (bool(message.get("more_body")), known(), message.get("body", b""))))

    gateway_done = asyncio.Event()
    try:
        await app(scope, receive, send)
    finally:
        gateway_done.set()
        await gateway.stop()
    bodies = [detail for kind, detail in events if kind == "body"]
    assert events[-1] == ("released", "stream-1") and len(events) == len(bodies) + 1
    assert all(still_known for _, still_known, _ in bodies), "released while the stream was still going out"
    assert bodies[-1][0] is False  # the last message of the response came before the release
    assert b"data: [DONE]" in b"".join(chunk for _, _, chunk in bodies)
    assert not known()


HARNESS_HEADERS = [
    "x-session-id",  # SkyRL
    "x-litellm-session-id",  # OpenHands through litellm
    "x-claude-code-session-id",  # Claude Code
    "session-id",  # Codex CLI
    "thread-id",  # Codex CLI
    "x-dynamo-trajectory-id",  # Dynamo
    SESSION,  # Dynamo's older name
]


@pytest.mark.parametrize("rank", range(len(HARNESS_HEADERS)))
def test_each_harness_session_header_names_the_program_over_those_after_it(rank: int) -> None:
    headers = {name: f"id-{i}" for i, name in enumerate(HARNESS_HEADERS) if i >= rank}
    assert pop_program_id({}, headers) == f"id-{rank}"
    assert pop_program_id({}, headers | {"x-program-id": "own"}) == "own"


@pytest.mark.anyio
async def test_a_claude_code_subagent_is_a_program_of_its_own_under_its_sessions(gateway_app) -> None:
    client, _ = await gateway_app()
    session = {"x-claude-code-session-id": "sess"}
    for headers in (session, session | {"x-claude-code-agent-id": "a1"}):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
    parents = {p["program_id"]: p["parent"] for p in (await client.get("/programs")).json()["programs"]}
    assert parents == {"sess": None, "sess/a1": "sess"}


@pytest.mark.anyio
async def test_a_trajectorys_final_request_releases_it_and_its_parent_is_named(gateway_app) -> None:
    released: list[str] = []
    client, _ = await gateway_app(on_release=released.append)
    await client.post("/v1/chat/completions", json=CHAT, headers={"x-dynamo-trajectory-id": "root"})
    child = {"x-dynamo-trajectory-id": "leaf", "x-dynamo-parent-trajectory-id": "root"}
    await client.post("/v1/chat/completions", json=CHAT, headers=child)
    parents = {p["program_id"]: p["parent"] for p in (await client.get("/programs")).json()["programs"]}
    assert parents == {"root": None, "leaf": "root"}
    final = await client.post("/v1/chat/completions", json=CHAT, headers=child | {"x-dynamo-trajectory-final": "true"})
    assert final.status_code == 200 and released == ["leaf"] and await program_ids(client) == ["root"]


@pytest.mark.anyio
async def test_headers_the_gateway_does_not_act_on_reach_the_worker_unchanged(gateway_app) -> None:
    client, worker = await gateway_app()
    headers = {"x-session-id": "traj-1", "x-trace": "abc", "user-agent": "agent/1.0", "x-program-id": "p"}
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
    (_, _, seen), *_ = [r for r in worker.requests if r[1] == "/v1/chat/completions"]
    assert seen["x-session-id"] == "traj-1" and seen["x-trace"] == "abc" and seen["user-agent"] == "agent/1.0"
    assert "x-program-id" not in seen
