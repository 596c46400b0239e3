"""Groups of programs (the samples of one task in an RL rollout): named or derived, known to the
scheduler, shown by `/programs` and `status`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from thunderctl.bench.recorded import recorded_swe_lite
from thunderctl.cli import app
from thunderctl.daemon.control import build_control_app
from thunderctl.daemon.status import ClusterStatus
from thunderctl.gateway.identity import ConversationIndex, Turn
from thunderctl.gateway.requests import BadRequest, pop_group_id
from thunderctl.sim.rollout import GroupFigures, Rollout, sample_of
from thunderctl.status_screen import status_renderable


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("body", "headers", "group"),
    [
        ({"group_id": "top"}, {}, "top"),
        ({"extra_body": {"group_id": "extra"}}, {}, "extra"),
        ({}, {"x-group-id": "header"}, "header"),
        ({"group_id": "top", "extra_body": {"group_id": "extra"}}, {"x-group-id": "header"}, "top"),
        ({"extra_body": {"group_id": "extra"}}, {"x-group-id": "header"}, "extra"),
        ({"group_id": 7}, {}, "7"),
        ({}, {"x-group-id": ""}, None),
    ],
)
def test_the_group_is_read_from_the_body_extra_body_and_the_header_in_that_order(body, headers, group) -> None:
    assert pop_group_id(body, headers) == group
    assert "group_id" not in body and "group_id" not in body.get("extra_body", {}), "the engine never sees it"


def test_a_bad_group_id_is_refused_naming_where_it_was() -> None:
    with pytest.raises(BadRequest, match="the x-group-id header must be 1-256 characters"):
        pop_group_id({}, {"x-group-id": "g" * 257})
    with pytest.raises(BadRequest, match="extra_body.group_id must be a string, not an array"):
        pop_group_id({"extra_body": {"group_id": []}}, {})


def chat(task: str) -> dict:
    return {"messages": [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": task}]}


def test_derived_programs_that_share_a_first_prompt_share_a_group() -> None:
    index = ConversationIndex(64)
    samples = [index.follow(Turn(**chat("Fix issue 42."))) for _ in range(3)]
    other = index.follow(Turn(**chat("Fix issue 43.")))
    assert all(s is not None and other is not None for s in [*samples, other])
    assert len({s.program_id for s in samples}) == 3, "each sample its own program"
    assert len({s.group for s in samples}) == 1 and samples[0].group != other.group


def test_completions_of_the_same_token_ids_share_a_group() -> None:
    index = ConversationIndex(64)
    first, second, other = (index.follow(Turn(prompt=ids)) for ids in ([1, 2, 3], [1, 2, 3], [1, 2, 4]))
    assert first.group == second.group != other.group and first.program_id != second.program_id


@pytest.mark.anyio
async def test_programs_shows_each_programs_group_and_the_groups_done_and_total(gateway_app) -> None:
    client, _ = await gateway_app()
    request = {"model": "fake", "max_tokens": 2, **chat("Fix issue 42.")}
    for program in ("s0", "s1"):
        answered = await client.post(
            "/v1/chat/completions", json=request, headers={"x-program-id": program, "x-group-id": "task-42"}
        )
        assert answered.status_code == 200
    for _ in range(2):  # two unnamed samples of another task: a derived group
        assert (await client.post("/v1/chat/completions", json={**request, **chat("Fix 43.")})).status_code == 200
    await client.post("/programs/release", json={"program_id": "s0"})
    view = (await client.get("/programs")).json()
    groups = {p["program_id"]: p["group"] for p in view["programs"]}
    assert groups["s1"] == "task-42"
    derived = [g for p, g in groups.items() if p != "s1"]
    assert len(derived) == 2 and derived[0] == derived[1] and derived[0].startswith("first-")
    assert view["groups"] == [
        {"group_id": "task-42", "done": 1, "total": 2},
        {"group_id": derived[0], "done": 0, "total": 2},
    ]


@pytest.mark.anyio
async def test_status_shows_the_groups_and_the_nearest_done(daemon_of) -> None:
    daemon = daemon_of()
    await daemon.gateway.start()
    try:
        sched = daemon.gateway.scheduler
        for sample in range(4):
            sched.on_request(f"s{sample}", 100, group="task-7")
        sched.release("s0")
        sched.on_request("o0", 100, group="task-8")
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_control_app(daemon)), base_url="http://control"
        ) as control:
            wire = (await control.get("/status")).json()
    finally:
        await daemon.gateway.stop()
    assert wire["scheduler"]["groups"] == [
        {"group_id": "task-7", "done": 1, "total": 4},
        {"group_id": "task-8", "done": 0, "total": 1},
    ]
    console = Console(width=80, record=True, color_system=None)
    console.print(status_renderable(ClusterStatus.model_validate(wire)))
    assert "groups: 2 · finished 0 · nearest done: task-7 1/4 · task-8 0/1" in console.export_text()


def test_the_samples_of_a_task_share_its_first_prompt_and_differ_after_it() -> None:
    task = recorded_swe_lite()[0]
    samples = [sample_of(task, random.Random(f"test/{k}")) for k in range(4)]
    assert {s.steps[0].prompt_tokens for s in samples} == {task.steps[0].prompt_tokens}
    assert len({tuple((st.prompt_tokens, st.tool_s) for st in s.steps) for s in samples}) == 4
    assert all(s.steps[-1].tool_s == 0 for s in samples), "a sample ends after its last answer"


def test_a_rollout_is_tasks_x_samples_and_says_how_to_write_it() -> None:
    assert Rollout.parse("32x8").programs == 256
    with pytest.raises(ValueError, match="TASKSxSAMPLES, e.g. 32x8"):
        Rollout.parse("32 by 8")


def test_the_median_group_counts_the_groups_that_never_ended_as_last() -> None:
    # 4 groups of 2: groups 0 and 1 ended at 10 s and 20 s, group 2 has a sample left, no sample of group 3 ended.
    ended = [(0, 5.0), (1, 10.0), (2, 20.0), (3, 15.0), (4, 30.0)]
    figures = GroupFigures.of(ended, Rollout(4, 2))
    assert (figures.done, figures.median_s, figures.last_s) == (2, None, None)
    figures = GroupFigures.of([*ended, (5, 40.0)], Rollout(4, 2))
    assert (figures.done, figures.median_s, figures.last_s) == (3, 30.0, None)  # between the 2nd and the 3rd to end


def test_bench_simulate_rollout_ends_the_batch_in_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    result = CliRunner().invoke(
        app,
        ["bench", "simulate", "--preset", "cpu-tiny", "--workers", "2", "--rollout", "2x2", "--scale", "0.2",
         "--jobs", "1", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["parameters"]["rollout"] == "2x2"
    arms = report["points"][0]["arms"]
    assert len(arms) == 10
    for name, figures in arms.items():
        assert figures["programs_completed"] == 4, name
        assert figures["makespan_s"] is not None and figures["makespan_s"] == figures["group_last_s"], name
        assert 0 < figures["group_median_s"] <= figures["group_last_s"], name
        assert figures["programs_per_min"] == pytest.approx(4 / figures["makespan_s"] * 60), name
    assert "last ÷ median" in result.output
