"""The gateway's memory under thousands of programs (benchmarks/sim_soak.py): what a waiting request
holds, measured with tracemalloc."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from support import eventually
from thunderctl.gateway import Gateway, WorkerLink
from thunderctl.gateway.requests import prompt_shape

PROGRAMS = 16
PROMPT_CHARS = 200_000


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_request_waiting_for_its_resume_holds_its_prompt_once(fake_backend) -> None:
    worker = fake_backend()
    gateway = Gateway([WorkerLink("fake", worker.url)])
    await gateway.start()
    gateway.drain("fake")  # no room anywhere: every program's first request waits
    waiting: list[asyncio.Task] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(PROGRAMS):
            # Each its own prompt (no string shared between them), dropped here once handed over.
            content = f"{i} " + "x" * PROMPT_CHARS
            body = {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
            shape = prompt_shape(body)
            del content
            waiting.append(asyncio.create_task(gateway.relay("/v1/chat/completions", body, f"p{i}", shape)))
            del body
        await eventually(
            lambda: sum(p.waiting_since is not None for p in gateway.scheduler.paused()) == PROGRAMS,
            what="every request to wait for its resume",
        )
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await gateway.stop()
    # Once: its encoded payload; twice (its parsed body as well) is what 2,048 waiting programs paid.
    assert held < 1.5 * PROGRAMS * PROMPT_CHARS, f"{held / (PROGRAMS * PROMPT_CHARS):.2f} prompts held per request"
