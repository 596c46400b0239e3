"""The load generator's retry rules: a request that got no byte of its answer is sent again
(`retry_unanswered_s`), one cut mid-answer fails (on a real simulated worker); an idempotent release
is sent again while it gets no answer (`release_retry_s`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from thunderctl.bench import requests
from thunderctl.bench.closed_loop import ClosedLoop, LoadSpec, Target, run_load
from thunderctl.bench.requests import AnswerCut, resend_unanswered
from thunderctl.bench.results import LoadResult
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.engines.simulated.process import sim_command
from thunderctl.processes import pick_free_port

ONE_STEP = AgentShape(
    system_prompt_tokens=50,
    task_tokens=Uniform(20, 20),
    observation_tokens=Uniform(20, 20),
    completion_tokens=Uniform(8, 8),
    steps=Uniform(1, 1),
    tool_seconds=Uniform(0, 0),
)


def load_in_background(url: str, spec: LoadSpec) -> tuple[threading.Thread, list[LoadResult]]:
    results: list[LoadResult] = []
    thread = threading.Thread(target=lambda: results.append(asyncio.run(run_load(Target.direct([url]), spec, []))))
    thread.start()
    return thread, results


@pytest.mark.slow
def test_a_refused_request_is_sent_again_until_the_server_answers(tmp_path: Path) -> None:
    port = pick_free_port()
    spec = LoadSpec(concurrency=1, programs=1, shape=ONE_STEP, retry_unanswered_s=60)
    thread, results = load_in_background(f"http://127.0.0.1:{port}", spec)
    time.sleep(1)  # refused meanwhile: nothing listens yet
    with (tmp_path / "sim.log").open("wb") as log:
        sim = subprocess.Popen(sim_command(sys.executable, port, "127.0.0.1", ["--time-scale", "0"]), stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    try:
        thread.join(timeout=120)
    finally:
        sim.terminate()
        sim.wait(timeout=10)
    (result,) = results
    assert result.steps_failed == 0 and result.programs_completed == 1
    assert result.unanswered_retries >= 2


@pytest.mark.slow
def test_a_request_cut_mid_answer_fails_and_is_not_sent_again(start_sim) -> None:
    sim = start_sim("--time-scale", "40")  # each token ~0.6 s: the answer is still streaming when it dies
    spec = LoadSpec(concurrency=1, programs=1, shape=ONE_STEP, stream=True, retry_unanswered_s=60)
    thread, results = load_in_background(sim.url, spec)
    time.sleep(2)
    sim.process.kill()
    thread.join(timeout=60)
    (result,) = results
    assert result.steps_failed == 1 and result.unanswered_retries == 0
    assert result.records[0].error.startswith("AnswerCut: ")
    assert result.summary()["step_errors"] == {result.records[0].error[:160]: 1}  # what the report says failed


def closed_loop_on(handler, spec: LoadSpec) -> ClosedLoop:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return ClosedLoop(client, Target.gateway("http://gateway"), spec, salt="s", tokens_per_word=1.0)


def test_a_release_that_gets_no_answer_is_sent_again_until_the_gateway_answers() -> None:
    calls: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) <= 2:
            raise httpx.ConnectTimeout("the gateway is slow to accept", request=request)
        return httpx.Response(200, json={"released": True})

    loop = closed_loop_on(gateway, LoadSpec(concurrency=1, programs=1, release_retry_s=30))
    loop.open_programs.add("p-1")
    asyncio.run(loop.release("p-1"))
    assert calls == ["/programs/release"] * 3
    assert loop.release_failures == [] and loop.unanswered_retries == 2
    assert [r.error for r in loop.resends] == ["ConnectTimeout: the gateway is slow to accept"] * 2


def test_a_release_still_unanswered_at_its_limit_fails_with_its_reason() -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection reset", request=request)

    loop = closed_loop_on(gateway, LoadSpec(concurrency=1, programs=1, release_retry_s=0.6))
    loop.open_programs.add("p-2")
    asyncio.run(loop.release("p-2"))
    (failure,) = loop.release_failures
    assert (failure.program_id, failure.error) == ("p-2", "ReadError: connection reset")
    assert loop.unanswered_retries >= 1


def test_a_request_not_connected_in_time_is_sent_again_but_one_cut_mid_answer_is_not() -> None:
    sent: list[int] = []

    async def connects_late() -> str:
        sent.append(1)
        if len(sent) < 3:
            raise httpx.ConnectTimeout("no connection in 10 s")
        return "answered"

    resent: list[Exception] = []
    assert asyncio.run(resend_unanswered(connects_late, 30, resent.append)) == "answered"
    assert [type(e) for e in resent] == [httpx.ConnectTimeout] * 2

    async def cut() -> str:
        raise AnswerCut("ReadError: reset after the status line")

    with pytest.raises(AnswerCut):
        asyncio.run(resend_unanswered(cut, 30, resent.append))
    assert len(resent) == 2


def test_resends_back_off_doubling_to_a_cap_so_a_crowd_does_not_come_back_at_once() -> None:
    waits: list[float] = []

    async def recorded_sleep(seconds: float) -> None:
        waits.append(seconds)

    attempts = iter(range(7))

    async def refused_six_times() -> str:
        if next(attempts) < 6:
            raise httpx.ConnectError("refused")
        return "answered"

    assert asyncio.run(resend_unanswered(refused_six_times, 60, lambda _: None, sleep=recorded_sleep)) == "answered"
    steps = [min(requests.UNANSWERED_RETRY_INTERVAL_S * 2**i, requests.UNANSWERED_RETRY_MAX_S) for i in range(6)]
    assert len(waits) == 6 and all(step / 2 <= wait <= step for wait, step in zip(waits, steps))
    assert steps[-1] == requests.UNANSWERED_RETRY_MAX_S


def test_a_client_that_keeps_no_idle_connection_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="keepalive_s"):
        LoadSpec(concurrency=1, programs=1, keepalive_s=0)


@pytest.mark.slow
def test_a_release_cut_off_by_the_deadline_is_sent_again_at_the_end() -> None:
    answered: list[str] = []  # programs whose release the gateway finished answering
    asked: list[str] = []

    async def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/programs/release":
            program_id = json.loads(request.content)["program_id"]
            await asyncio.sleep(0.4)  # the third ends at 1.2 s: the deadline (1 s) cancels it with the slot
            answered.append(program_id)
            return httpx.Response(200, json={"program_id": program_id, "released": True})
        asked.append(json.loads(request.content)["program_id"])
        answer = {"choices": [{"message": {"content": "done"}}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
        return httpx.Response(200, json=answer)

    # One-step programs answered at once, no tool time: the slot spends its time releasing.
    loop = closed_loop_on(gateway, LoadSpec(concurrency=1, duration_s=1.0, shape=ONE_STEP))
    loop.start_clock()
    asyncio.run(loop.execute())
    assert len(asked) >= 2 and set(answered) == set(asked)
    assert loop.open_programs == set() and loop.release_failures == []


def test_a_request_whose_one_attempt_outlasts_the_resend_time_is_still_sent_again() -> None:
    attempts: list[int] = []

    async def slow_then_answered() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            await asyncio.sleep(0.5)  # longer than the resend time: a connect noticed late
            raise httpx.ConnectTimeout("no connection in time")
        return "answered"

    assert asyncio.run(resend_unanswered(slow_then_answered, 0.3, lambda _: None)) == "answered"
    assert len(attempts) == 2
