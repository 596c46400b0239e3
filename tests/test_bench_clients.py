"""The closed loop's clients (named, unreleased, unchanged) and its whole-program figures."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from thunderctl.bench.closed_loop import ClosedLoop, LoadSpec, Target, run_load
from thunderctl.bench.results import combine_results
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.sim.agents import Client

THREE_STEPS = AgentShape(
    system_prompt_tokens=50,
    task_tokens=Uniform(20, 20),
    observation_tokens=Uniform(20, 20),
    completion_tokens=Uniform(8, 8),
    steps=Uniform(3, 3),
    tool_seconds=Uniform(0, 0),
)


def gateway_run(client: Client) -> tuple[list[dict], list[str]]:
    """Two programs through a gateway that answers every request: the bodies it got, and its releases."""
    bodies: list[dict] = []
    released: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/programs/release":
            released.append(body["program_id"])
            return httpx.Response(200, json={"released": True})
        bodies.append(body)
        answer = {"choices": [{"message": {"content": "done"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 8}}
        return httpx.Response(200, json=answer)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(gateway)) as http:
            spec = LoadSpec(concurrency=2, programs=2, shape=THREE_STEPS, client=client)
            loop = ClosedLoop(http, Target.gateway("http://gateway"), spec, salt="s", tokens_per_word=1.0)
            loop.start_clock()
            await loop.execute()

    asyncio.run(run())
    return bodies, released


@pytest.mark.parametrize(
    ("client", "named", "releases"),
    [(Client.NAMED, True, 2), (Client.UNRELEASED, True, 0), (Client.UNCHANGED, False, 0)],
)
def test_each_client_names_and_releases_its_programs_or_not(client, named, releases) -> None:
    bodies, released = gateway_run(client)
    assert len(bodies) == 6
    assert all(("program_id" in body) is named for body in bodies)
    assert len(released) == releases
    if releases:
        assert {body["program_id"] for body in bodies} == set(released)


def test_a_direct_arm_names_nothing_whatever_the_client() -> None:
    spec = LoadSpec(concurrency=1, programs=1, client=Client.NAMED)
    loop = ClosedLoop(httpx.AsyncClient(), Target.direct(["http://engine"]), spec, salt="s", tokens_per_word=1.0)
    assert not loop.names_programs and not loop.releases_programs


@pytest.mark.slow
def test_completed_programs_are_timed_whole_and_never_count_more_steps_than_were_served(start_sim) -> None:
    sim = start_sim("--time-scale", "0")
    shape = AgentShape(
        system_prompt_tokens=50, task_tokens=Uniform(20, 20), observation_tokens=Uniform(20, 20),
        completion_tokens=Uniform(8, 8), steps=Uniform(2, 5), tool_seconds=Uniform(0.05, 0.3),
    )  # fmt: skip
    spec = LoadSpec(concurrency=3, shape=shape, duration_s=4.0, warmup_s=0.5, age_initial_programs=True)
    slices = [asyncio.run(run_load(Target.direct([sim.url]), spec, [])) for _ in range(2)]
    for result in [*slices, combine_results(slices)]:
        runs = result.program_runs
        assert len(runs) == result.programs_completed > 0
        assert sum(run.steps for run in runs) <= result.steps_ok
        assert result.steady_programs_completed <= result.programs_completed
        assert len(result.steady_program_s) <= result.steady_programs_completed
        summary = result.summary()
        assert summary["programs_per_min"] == pytest.approx(60 * result.steady_programs_completed / result.window_s)
        assert summary["program_p50_s"] <= summary["program_p90_s"] <= summary["program_p99_s"]
        # A whole program's time holds all its steps: each step's answer, and the tool times between.
        steps_by_program = {}
        for record in result.records:
            steps_by_program.setdefault(record.program_id, []).append(record)
        for run in runs:
            steps = steps_by_program[run.program_id]
            assert run.steps == len(steps)
            assert run.latency_s >= sum(step.latency_s for step in steps)
            assert run.start_s == min(step.start_s for step in steps)
