"""Resumed programs first inside the engine: a `priority` only when the workers schedule by it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.answers import RESUMED_PRIORITY, resume_priority

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("args", "priority"),
    [
        (["--scheduling-policy", "priority"], RESUMED_PRIORITY),
        (["--max-num-seqs", "64", "--scheduling-policy=priority"], RESUMED_PRIORITY),
        (["--scheduling-policy", "fcfs"], None),
        ([], None),
    ],
)
def test_the_profiles_engine_args_say_whether_a_priority_is_sent(args: list[str], priority: int | None) -> None:
    assert resume_priority(args) == priority


@pytest.mark.anyio
@pytest.mark.parametrize("priority", [RESUMED_PRIORITY, None])
async def test_a_request_that_waited_for_its_resume_carries_the_priority_only_when_asked(
    fake_backend, priority
) -> None:
    worker = fake_backend()
    gateway = Gateway([WorkerLink("fake", worker.url)], resumed_priority=priority)
    await gateway.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://gateway")
    try:
        headers = {"x-program-id": "p"}
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
        gateway.scheduler.drain("fake")  # p is ACTING: it pauses now, and its next request waits
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=headers))
        while gateway.scheduler.programs["p"].waiting_since is None:
            await asyncio.sleep(0.01)
        gateway.scheduler.set_schedulable("fake", True)  # it resumes
        assert (await waiting).status_code == 200
    finally:
        await client.aclose()
        await gateway.stop()
    first, resumed = worker.bodies
    assert "priority" not in first  # admitted at once: nothing to boost
    assert resumed.get("priority") == priority if priority is not None else "priority" not in resumed
