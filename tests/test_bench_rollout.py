"""`bench rollout`: batches of GRPO groups, their samples, a short batch through a gateway, and bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from thunderctl.bench.cli import bench_app
from thunderctl.bench.closed_loop import ClosedLoop, LoadSpec, Target
from thunderctl.bench.recorded import recorded_swe_lite
from thunderctl.bench.replay import TraceWorkload
from thunderctl.bench.rollout import RolloutBatch
from thunderctl.gateway.requests import GROUP_HEADER
from thunderctl.sim.rollout import SampledWorkload

TASKS, SAMPLES = 3, 4


def batch(**options: object) -> RolloutBatch:
    return RolloutBatch(0.25, programs=tuple(recorded_swe_lite()), samples=SAMPLES, **options)  # type: ignore[arg-type]


def test_the_samples_of_a_task_share_its_first_prompt_and_then_differ() -> None:
    workload = batch()
    for task in range(TASKS):
        samples = [workload.program(seed=0, index=task * SAMPLES + k) for k in range(SAMPLES)]
        assert len({s.steps[0].prompt_tokens for s in samples}) == 1
        answers = {tuple(step.completion_tokens for step in s.steps) for s in samples}
        assert len(answers) == SAMPLES  # each sample answers at its own lengths
    first_prompts = {workload.program(seed=0, index=task * SAMPLES).steps[0].prompt_tokens for task in range(TASKS)}
    assert len(first_prompts) == TASKS  # distinct tasks are distinct recorded runs


def test_a_batch_is_the_same_for_the_same_seed_and_another_for_another() -> None:
    workload = batch()
    assert workload.program(seed=3, index=5) == workload.program(seed=3, index=5)
    assert workload.program(seed=3, index=5) != workload.program(seed=4, index=5)


def test_the_simulator_draws_the_same_batch_for_the_same_seed() -> None:
    workload = batch()
    simulated = SampledWorkload(TraceWorkload(0.25, programs=tuple(recorded_swe_lite())), SAMPLES)
    for index in range(TASKS * SAMPLES):
        measured = [(s.prompt_tokens, s.completion_tokens, s.tool_s) for s in workload.program(2, index).steps]
        assert measured == [(s.prompt_tokens, s.completion_tokens, s.tool_s) for s in simulated.program(2, index).steps]


def test_max_steps_cuts_the_tasks_and_the_samples_vary_around_the_cut() -> None:
    workload = batch(max_steps=6)
    lengths = [len(workload.program(seed=0, index=i).steps) for i in range(40)]
    assert max(lengths) < 6 * 3 and min(lengths) >= 1
    assert len(set(lengths)) > 1
    assert all(workload.program(seed=0, index=i).steps[-1].tool_s == 0.0 for i in range(40))


@pytest.mark.slow
def test_through_the_gateway_samples_name_their_group_and_send_their_task_text() -> None:
    first_requests: dict[str, tuple[str | None, str]] = {}

    def gateway(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/programs/release":
            return httpx.Response(200, json={"released": True})
        first_requests.setdefault(
            body["program_id"], (request.headers.get(GROUP_HEADER), body["messages"][1]["content"])
        )
        answer = {"choices": [{"message": {"content": "done"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 8}}
        return httpx.Response(200, json=answer)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(gateway)) as http:
            spec = LoadSpec(
                concurrency=TASKS * SAMPLES,
                programs=TASKS * SAMPLES,
                shape=batch(max_steps=2),
                samples_per_task=SAMPLES,
            )
            loop = ClosedLoop(http, Target.gateway("http://gateway"), spec, salt="s", tokens_per_word=1.0)
            loop.start_clock()
            await loop.execute()

    asyncio.run(run())
    groups: dict[str, set[str]] = {}
    for group, task_text in first_requests.values():
        assert group is not None
        groups.setdefault(group, set()).add(task_text)
    assert len(first_requests) == TASKS * SAMPLES
    assert len(groups) == TASKS and all(len(texts) == 1 for texts in groups.values())
    assert len({text for texts in groups.values() for text in texts}) == TASKS


@pytest.mark.slow
def test_a_short_batch_runs_through_the_gateway_and_straight_to_the_engine(start_sim, start_gateway) -> None:
    sim = start_sim("--time-scale", "0")
    gateway = start_gateway([sim.url])
    args = [
        "rollout", "--endpoint", f"{gateway.url}/v1", "--engine", sim.url, "--tasks", "2", "--samples", "2",
        "--max-steps", "3", "--scale", "0.05", "--time-scale", "0.01", "--json",
    ]  # fmt: skip

    run = CliRunner().invoke(bench_app, args)

    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout)
    assert set(report["arms"]) == {"cluster", "direct"}
    for arm in report["arms"].values():
        assert arm["programs_completed"] == arm["programs"] == 4
        assert arm["failed_requests"] == 0
        assert arm["makespan_s"] > 0
    for figures in report["batches"]:
        assert figures["group_median_s"] <= figures["group_last_s"] == figures["makespan_s"]
    assert (
        report["ratios"]["makespan_s"]
        == report["arms"]["cluster"]["makespan_s"] / report["arms"]["direct"]["makespan_s"]
    )
    assert gateway.programs() == {}  # every sample was released


def test_a_group_without_samples_is_refused() -> None:
    run = CliRunner().invoke(bench_app, ["rollout", "--samples", "0"])
    assert run.exit_code == 2
    assert "Invalid value for '--samples'" in run.output and "greater than or equal to 1" in run.output


def test_a_missing_trace_is_refused_before_any_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a short path: the error box does not wrap it
    run = CliRunner().invoke(bench_app, ["rollout", "--trace", "runs.jsonl"])
    assert run.exit_code == 2
    assert "Invalid value for '--trace'" in run.output and "'runs.jsonl' does not exist" in run.output
