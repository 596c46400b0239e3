"""`previous_response_id` through the cluster: the gateway keeps the responses it relayed and sends
each turn self-contained, so a chain holds whichever worker serves its next turn."""

from __future__ import annotations

import httpx
import pytest

from thunderctl.gateway import Gateway, WorkerLink, build_app


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def turn(text: str, previous: str | None = None, **fields: object) -> dict:
    body = {"model": "fake", "input": text, "max_output_tokens": 3, **fields}
    return body | ({"previous_response_id": previous} if previous else {})


@pytest.fixture
async def two_workers(fake_backend):
    workers = [fake_backend(), fake_backend()]
    gateway = Gateway([WorkerLink(f"w{i}", w.url) for i, w in enumerate(workers)])
    await gateway.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://g")
    yield client, gateway, workers
    await client.aclose()
    await gateway.stop()


def responses_bodies(worker) -> list[dict]:
    return [b for b in worker.bodies if "input" in b]


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_chain_whose_next_turn_lands_on_another_worker_gets_its_whole_history(two_workers, stream) -> None:
    client, gateway, workers = two_workers
    first = await client.post("/v1/responses", json=turn("list the files", program_id="task"))
    assert first.status_code == 200
    first_id = first.json()["id"]
    gateway.drain(gateway.scheduler.programs["task"].worker)  # the next turn must go to the other worker
    if stream:
        async with client.stream("POST", "/v1/responses", json=turn("now the tests", first_id, stream=True)) as events:
            assert events.status_code == 200 and b"response.completed" in b"".join(
                [c async for c in events.aiter_bytes()]
            )
    else:
        assert (await client.post("/v1/responses", json=turn("now the tests", first_id))).status_code == 200
    first_at, second_at = (
        next(i for i, w in enumerate(workers) for b in responses_bodies(w) if isinstance(b["input"], kind))
        for kind in (str, list)
    )
    sent = next(b for b in responses_bodies(workers[second_at]) if isinstance(b["input"], list))
    assert first_at != second_at and "previous_response_id" not in sent
    texts = [str(item) for item in sent["input"]]
    assert len(sent["input"]) == 3 and "list the files" in texts[0] and "now the tests" in texts[2]
    assert sent["input"][1]["type"] == "message" and sent["input"][1]["role"] == "assistant"
    assert [p["steps"] for p in (await client.get("/programs")).json()["programs"]] == [2]


@pytest.mark.anyio
async def test_a_kept_response_can_be_read_back_and_an_unknown_one_is_vllms_404(two_workers) -> None:
    client, _, _ = two_workers
    answered = (await client.post("/v1/responses", json=turn("hi", program_id="p"))).json()
    assert (await client.get(f"/v1/responses/{answered['id']}")).json() == answered
    cancel = await client.post(f"/v1/responses/{answered['id']}/cancel")
    assert cancel.status_code == 400 and "synchronous" in cancel.json()["error"]["message"]
    for missing in (client.get("/v1/responses/resp_nope"), client.post("/v1/responses", json=turn("x", "resp_nope"))):
        refused = await missing
        assert (
            refused.status_code == 404
            and refused.json()["error"]["message"] == "Response with id 'resp_nope' not found."
        )


@pytest.mark.anyio
async def test_a_released_programs_chain_is_forgotten_and_an_unstored_turn_is_never_kept(two_workers) -> None:
    client, _, _ = two_workers
    kept = (await client.post("/v1/responses", json=turn("hi", program_id="p"))).json()["id"]
    unstored = (await client.post("/v1/responses", json=turn("hi", program_id="q", store=False))).json()["id"]
    await client.post("/programs/release", json={"program_id": "p"})
    for response_id in (kept, unstored):
        assert (await client.get(f"/v1/responses/{response_id}")).status_code == 404
