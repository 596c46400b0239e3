"""The engines' routes through the gateway: the public ones relayed (to the worker of the program a
request names), the control ones refused before any worker sees them, any other path a 404 that
lists what is served."""

from __future__ import annotations

import httpx
import pytest

from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.routes import CONTROL_PATHS, RELAYED_ROUTES

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_tokenize_and_a_models_card_are_relayed_as_vllm_answers_them(gateway_app) -> None:
    client, worker = await gateway_app()
    tokenized = await client.post("/tokenize", json={"model": "fake", "prompt": "one two three"})
    assert tokenized.status_code == 200 and tokenized.json()["count"] == 3
    card = await client.get("/v1/models/fake")
    assert ("POST", "/tokenize") in [(m, p) for m, p, _ in worker.requests]
    assert ("GET", "/v1/models/fake") in [(m, p) for m, p, _ in worker.requests] and card.status_code == 404


@pytest.mark.anyio
@pytest.mark.parametrize("route", RELAYED_ROUTES, ids=lambda r: r.path)
async def test_every_public_route_reaches_a_worker_with_its_query(gateway_app, route) -> None:
    client, worker = await gateway_app()
    path = route.path.replace("{model_id:path}", "fake")
    await client.request(route.method, f"{path}?x=1", json=None if route.method == "GET" else {"model": "fake"})
    assert (route.method, f"{path}?x=1") in [(m, p) for m, p, _ in worker.requests]


@pytest.mark.anyio
@pytest.mark.parametrize("path", CONTROL_PATHS)
async def test_no_control_route_is_a_clients(gateway_app, path) -> None:
    client, worker = await gateway_app()
    refused = await client.post(path, json={})
    assert refused.status_code == 403 and "thunderctl pause" in refused.json()["error"]["message"]
    assert path not in [p for _, p, _ in worker.requests]


@pytest.mark.anyio
async def test_a_path_not_served_gets_a_404_that_lists_what_is(gateway_app) -> None:
    client, worker = await gateway_app()
    missing = await client.post("/v1/chat/complete", json=CHAT)
    message = missing.json()["error"]["message"]
    assert missing.status_code == 404 and "/v1/chat/complete is not served" in message
    assert "/v1/responses" in message and "/v1/messages" in message
    assert "/v1/chat/complete" not in [p for _, p, _ in worker.requests]


@pytest.mark.anyio
async def test_the_messages_routes_refuse_in_anthropics_error_shape(gateway_app) -> None:
    client, _ = await gateway_app()
    for path, body in (("/v1/messages?beta=true", {"messages": []}), ("/v1/messages/batches", {})):
        refused = await client.post(path, json=body)
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] in (
            "invalid_request_error",
            "not_found_error",
        )
        assert refused.status_code in (400, 404)


@pytest.mark.anyio
async def test_a_request_that_names_a_placed_program_is_relayed_to_its_worker(fake_backend) -> None:
    workers = [fake_backend(), fake_backend()]
    gateway = Gateway([WorkerLink(f"w{i}", w.url) for i, w in enumerate(workers)])
    await gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://g"
        ) as client:
            for program in ("p0", "p1", "p2"):
                await client.post("/v1/chat/completions", json=CHAT, headers={"x-program-id": program})
            placed = gateway.scheduler.programs["p2"].worker
            await client.post("/tokenize", json={"model": "fake", "prompt": "a b"}, headers={"x-program-id": "p2"})
        owner = workers[int(placed[1:])]
        assert [p for _, p, _ in owner.requests].count("/tokenize") == 1
    finally:
        await gateway.stop()
