"""Unchanged clients through a real gateway (`thunderctl serve`) in front of a simulated vLLM worker:
no program id anywhere, and each conversation is one program all the same."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai import OpenAI

from support import BASH_TOOLS, wait_for
from thunderctl.daemon.control import build_control_app
from thunderctl.daemon.status import ClusterStatus

MODEL = "sim"
STEPS = 6
SYSTEM = {"role": "system", "content": "You are a software engineer. Use the bash tool. " * 20}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def served(start_sim, start_gateway):
    """A gateway in front of a simulated worker that answers at once; gateway options as given."""

    def start(*options: str):
        sim = start_sim("--time-scale", "0", "--served-model-name", MODEL)
        return start_gateway([sim.url], "--scheduler", "tick_interval_s=0.1", *options)

    return start


@pytest.mark.slow
def test_the_openai_sdks_tool_calling_loop_is_one_program_per_conversation(served) -> None:
    gateway = served()
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="-")
    conversations = [[SYSTEM, {"role": "user", "content": f"Fix bug number {i}."}] for i in range(3)]
    for step in range(STEPS):
        for messages in conversations:
            response = client.chat.completions.create(model=MODEL, messages=messages, tools=BASH_TOOLS, max_tokens=8)
            message = response.choices[0].message
            assert message.tool_calls, "the simulated worker answers a request that offers tools with a tool call"
            messages.append(message)  # the SDK's own object, as OpenAI's guide does
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ran step {step}"})
    programs = gateway.programs()
    assert sorted(p["steps"] for p in programs.values()) == [STEPS] * len(conversations)
    assert all(p["derived"] for p in programs.values())


@pytest.mark.slow
def test_each_program_is_listed_with_the_tool_its_last_answer_called(served) -> None:
    gateway = served()
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="-")
    called = {}
    for choice, tool in [("auto", "bash"), ("none", None)]:  # a tool call, and an answer that calls none
        messages = [SYSTEM, {"role": "user", "content": f"Answer with tool choice {choice}."}]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=BASH_TOOLS, tool_choice=choice, max_tokens=4
        )
        called[raw.headers["x-program-id"]] = tool
    assert {program_id: p["tool"] for program_id, p in gateway.programs().items()} == called


@pytest.mark.slow
def test_64_conversations_at_once_are_64_programs_each_step_its_own(served) -> None:
    gateway = served()
    # 8 of them are the n samples of one task: the same first request.
    firsts = [f"Task {i}: make the tests pass." if i >= 8 else "Task 0: make the tests pass." for i in range(64)]
    given: list[list[str]] = [[] for _ in firsts]

    async def converse(i: int, client: httpx.AsyncClient) -> None:
        messages = [SYSTEM, {"role": "user", "content": firsts[i]}]
        for step in range(STEPS):
            body = {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                given[i].append(response.headers["x-program-id"])
                chunks = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
            answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"{i}/{step}"}]

    async def run() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120, headers=gateway.headers) as client:
            await asyncio.gather(*(converse(i, client) for i in range(64)))

    asyncio.run(run())
    programs = gateway.programs()
    assert len(programs) == 64 and all(p["steps"] == STEPS and p["derived"] for p in programs.values())
    # From its second step on, a conversation is one program, and no two share one.
    assert all(len(set(ids[1:])) == 1 for ids in given)
    assert len({ids[-1] for ids in given}) == 64
    # The 56 whose first request was their own are one program from their first step (the 8 alike
    # are indistinguishable until their histories differ, and each still gets a program of its own).
    assert all(len(set(ids)) == 1 for ids in given[8:])
    # The 8 alike are one group (the samples of one task), each of the others a group of its own.
    groups = [programs[ids[-1]]["group"] for ids in given]
    assert len(set(groups[:8])) == 1 and len(set(groups)) == 57


@pytest.mark.slow
def test_a_token_id_prompt_that_extends_the_last_one_continues_its_program(served) -> None:
    gateway = served()
    prompt = list(range(100, 400))
    for _ in range(3):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "return_token_ids": True}
        answer = gateway.http.post("/v1/completions", json=body).json()["choices"][0]
        prompt = [*prompt, *range(900, 904), 7]  # what a rollout worker sends: prompt, completion ids, observation
        assert answer["text"]
    assert [p["steps"] for p in gateway.programs().values()] == [3]


@pytest.mark.slow
def test_with_derivation_off_unnamed_requests_are_served_unscheduled(served) -> None:
    gateway = served("--no-derive-programs")
    messages = [SYSTEM, {"role": "user", "content": "Fix it."}]
    response = gateway.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    assert response.status_code == 200 and "x-program-id" not in response.headers
    assert gateway.programs() == {}


@pytest.mark.slow
def test_derived_programs_and_requests_are_counted_in_the_metrics(served) -> None:
    gateway = served()
    messages = [SYSTEM, {"role": "user", "content": "Fix it."}]
    for step in range(3):
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        answer = gateway.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        messages = [*messages, answer, {"role": "user", "content": f"step {step}"}]
    gateway.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages[:2], "max_tokens": 4})
    assert gateway.metric("thunderctl_programs_derived") == 2
    assert gateway.metric("thunderctl_derived_requests_total", match="history") == 2
    assert gateway.metric("thunderctl_derived_requests_total", match="new") == 2
    assert gateway.metric("thunderctl_conversations_remembered") == 2


@pytest.mark.slow
def test_a_named_program_is_not_listed_as_derived(served) -> None:
    gateway = served()
    body = {"model": MODEL, "messages": [SYSTEM], "max_tokens": 4, "program_id": "named-1"}
    assert gateway.http.post("/v1/chat/completions", json=body).status_code == 200
    assert gateway.programs()["named-1"]["derived"] is False


@pytest.mark.slow
def test_a_released_derived_program_is_not_continued(served) -> None:
    gateway = served()
    messages = [SYSTEM, {"role": "user", "content": "Fix it."}]
    first = gateway.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    program = first.headers["x-program-id"]
    assert gateway.http.post("/programs/release", json={"program_id": program}).json()["released"]
    messages = [*messages, first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    after = gateway.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    assert after.headers["x-program-id"] != program


@pytest.mark.anyio
@pytest.mark.parametrize("derive", [True, False])
async def test_a_clusters_profile_decides_whether_programs_are_derived(daemon_of, derive: bool) -> None:
    daemon = daemon_of(derive_programs=derive)
    await daemon.gateway.start()
    try:
        body = {"model": "fake", "messages": [SYSTEM], "max_tokens": 2}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=daemon.app), base_url="http://gw:8300"
        ) as client:
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        control = httpx.ASGITransport(app=build_control_app(daemon))
        async with httpx.AsyncClient(transport=control, base_url="http://control") as client:
            view = ClusterStatus.model_validate((await client.get("/status")).json())
    finally:
        await daemon.gateway.stop()
    assert view.scheduler.programs.derived == (1 if derive else 0)


@pytest.mark.slow
def test_a_streamed_tool_calling_loop_is_one_program_per_conversation(served) -> None:
    gateway = served()
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="-")
    conversations = [[SYSTEM, {"role": "user", "content": f"Fix bug number {i}."}] for i in range(2)]
    for step in range(3):
        for messages in conversations:
            stream = client.chat.completions.create(
                model=MODEL, messages=messages, tools=BASH_TOOLS, max_tokens=8, stream=True
            )
            call = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            for chunk in stream:  # the client puts the streamed call back together, as SDK users do
                for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    call["id"] = call["id"] or delta.id or ""
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"ran step {step}"})
    assert sorted(p["steps"] for p in gateway.programs().values()) == [3, 3]


@pytest.mark.slow
def test_a_conversation_ended_on_an_answer_that_calls_no_tool_gives_its_room_to_a_waiting_one(
    start_sim, start_gateway
) -> None:
    sim = start_sim(
        "--time-scale", "0", "--served-model-name", MODEL, "--kv-blocks", "64", "--block-size", "16",
        "--max-model-len", "1024",
    )  # fmt: skip
    # Programs charged their tokens only (no decode buffer, no lighter charge while in a tool):
    # a cache of 1,024 tokens holds two of the three below, not all three.
    settings = [
        "tick_interval_s=0.1",
        "ending.floor_s=2",
        "retention.enabled=false",
        "adaptive.enabled=false",
        "admission.buffer_tokens=0",
    ]
    gateway = start_gateway([sim.url], *(arg for setting in settings for arg in ("-s", setting)))
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="-", timeout=20, max_retries=0)

    def step(messages: list, tool: bool) -> str:
        """One turn of an OpenAI tool loop, a tool call and its result or (not `tool`) its final
        answer; returns the program the gateway gave it."""
        choice = {} if tool else {"tool_choice": "none"}
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=BASH_TOOLS, max_tokens=4, **choice
        )
        message = raw.parse().choices[0].message
        messages.append(message)
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
        return raw.headers["x-program-id"]

    def task(letter: str, words: int) -> list:
        """A first message of `words` tokens of 4 characters each, in every task, so that the
        gateway's estimate of a prompt's tokens (from its characters) is right."""
        return [{"role": "user", "content": " ".join(f"{letter}{k:03d}" for k in range(words))}]

    # Eight loops the gateway learns from: three tool calls (tools of 0.3, 0.3 and 2 s), then an
    # answer that calls none; nobody releases them, so they end by the law.
    taught = [task(letter, 60) for letter in "defghijk"]
    for tool_s in [0.3, 0.3, 2.0, 0.0]:
        for messages in taught:
            step(messages, tool=bool(tool_s))
        time.sleep(tool_s)
    wait_for(lambda: not gateway.programs(), timeout=60, what="the taught loops to end by the law")

    working = step(task("a", 280), tool=True)  # in its tool now, for less time than most tools took
    finished = step(task("b", 280), tool=False)  # its last answer: the kind every taught loop ended on
    waiting = step(task("c", 400), tool=True)  # with both others held it would not fit the cache
    programs = gateway.programs()
    assert programs[finished]["status"] == "paused", "its room went to the waiting one"
    assert programs[working]["status"] == "active" and programs[waiting]["status"] == "active"
