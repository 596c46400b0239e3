"""Traces: the JSONL format, the importers of mini-swe-agent's logs, and the gateway's recorder."""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from thunderctl.bench.importers import (
    AgentRun,
    CallUsage,
    decode_rate,
    import_runs,
    read_mini_swe_agent_trajectory,
    read_step_table,
)
from thunderctl.bench.recorded import RECORDED_SWE_LITE, RECORDED_SWE_LITE_SOURCE, recorded_swe_lite
from thunderctl.gateway.recorder import TraceRecorder
from thunderctl.traceformat import (
    TraceFormatError,
    TraceProgram,
    TraceStep,
    read_trace,
    write_trace,
)
from trajectories import step_table_line, write_trajectory

# (prompt tokens, completion tokens, created): four calls, 7, 3 and 10 s apart.
CALLS = [(1460, 246, 1000), (1900, 61, 1007), (2100, 500, 1010), (2700, 30, 1020)]


# --- the format ----------------------------------------------------------------------


def test_a_trace_reads_back_what_was_written(tmp_path: Path) -> None:
    programs = [
        TraceProgram(id="a", steps=(TraceStep(prompt_tokens=100, completion_tokens=10, tool_s=1.5),)),
        TraceProgram(
            id="b",
            env_prep_s=12.0,
            source="test",
            steps=(
                TraceStep(prompt_tokens=50, completion_tokens=5, tool_s=0.5),
                TraceStep(prompt_tokens=80, completion_tokens=7),
            ),
        ),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(programs, path) == 2
    assert read_trace(path) == programs
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"id": "a", "steps": [{"prompt_tokens": 100, "completion_tokens": 10, "tool_s": 1.5}]}


def test_prompt_growth_is_read_as_whole_prompts(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    steps = [
        {"prompt_growth": 1650, "completion_tokens": 90, "tool_s": 2},
        {"prompt_growth": 400, "completion_tokens": 30},
        {"prompt_growth": -50, "completion_tokens": 5},  # the agent shortened its history
    ]
    path.write_text(json.dumps({"id": "g", "steps": steps}) + "\n")
    (program,) = read_trace(path)
    assert [s.prompt_tokens for s in program.steps] == [1650, 2050, 2000]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "x", "steps": []}', "steps"),
        ('{"id": "x", "steps": [{"prompt_tokens": 0, "completion_tokens": 1}]}', "steps.0.prompt_tokens"),
        (
            '{"id": "x", "steps": [{"prompt_tokens": 5, "completion_tokens": 1, "tool_seconds": 2}]}',
            "steps.0.tool_seconds",
        ),
        ('{"steps": [{"prompt_tokens": 5, "completion_tokens": 1}]}', "id"),
        ("not json", "line"),
    ],
)
def test_a_bad_line_is_named_by_file_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"id": "ok", "steps": [{"prompt_tokens": 5, "completion_tokens": 1}]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceFormatError) as raised:
        read_trace(path)
    assert str(raised.value).startswith(f"{path}:3: {message}")


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceFormatError, match="no programs"):
        read_trace(tmp_path / "empty.jsonl")


def test_scaling_shrinks_tokens_and_keeps_steps_and_times() -> None:
    program = TraceProgram(
        id="p",
        steps=(
            TraceStep(prompt_tokens=1650, completion_tokens=89, tool_s=3.0),
            TraceStep(prompt_tokens=2000, completion_tokens=4),
        ),
    )
    scaled = program.scaled(0.1)
    assert [(s.prompt_tokens, s.completion_tokens, s.tool_s) for s in scaled.steps] == [(165, 9, 3.0), (200, 1, 0.0)]
    assert scaled.id == "p"


def test_a_gzipped_trace_reads_back_and_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    step = TraceStep(prompt_tokens=100, completion_tokens=10, tool_s=1.5)
    programs = [TraceProgram(id=f"p{i}", steps=(step,) * (i + 1)) for i in range(3)]
    first, second = tmp_path / "a" / "t.jsonl.gz", tmp_path / "b" / "t.jsonl.gz"
    write_trace(programs, first)
    write_trace(programs, second)
    assert first.read_bytes().startswith(b"\x1f\x8b")  # gzip
    assert read_trace(first) == programs
    assert first.read_bytes() == second.read_bytes()


# --- importers -----------------------------------------------------------------------


def test_a_mini_swe_agent_trajectory_gives_one_step_per_llm_call(tmp_path: Path) -> None:
    run = read_mini_swe_agent_trajectory(write_trajectory(tmp_path, "django__django-1", CALLS))
    program = run.program()
    assert program.id == "django__django-1" and program.source == "mini-swe-agent"
    # Without a decode rate a step's tool time is the whole gap to the next call; none after the last.
    assert [(s.prompt_tokens, s.completion_tokens, s.tool_s) for s in program.steps] == [
        (1460, 246, 7.0), (1900, 61, 3.0), (2100, 500, 10.0), (2700, 30, 0.0),
    ]  # fmt: skip


def test_a_decode_rate_takes_each_answers_generation_out_of_the_gap_after_it(tmp_path: Path) -> None:
    run = read_mini_swe_agent_trajectory(write_trajectory(tmp_path, "a", CALLS))
    # At 40 tokens/s: 246 tokens took 6.15 s of the 7, 61 took 1.525 of the 3, and 500 would
    # take 12.5 s, more than the 10 s gap: that tool gets no time rather than a negative one.
    assert [s.tool_s for s in run.program(decode_tokens_per_s=40).steps] == [0.85, 1.48, 0.0, 0.0]


def test_the_decode_rate_is_fitted_to_the_gaps() -> None:
    def run(completions: list[int], rate: float) -> AgentRun:
        created, calls = 0.0, []
        for completion in completions:
            calls.append(CallUsage(1000, completion, created))
            created += 2.0 + completion / rate  # a 2 s tool after each answer's generation
        return AgentRun("r", tuple(calls), "test")

    assert decode_rate([run([10, 300, 40], 80.0), run([700, 5, 120, 90], 80.0)]) == pytest.approx(80.0)
    with pytest.raises(TraceFormatError, match="two lengths"):
        decode_rate([run([50, 50, 50], 80.0)])
    shrinking = AgentRun("s", (CallUsage(10, 10, 0), CallUsage(10, 500, 9), CallUsage(10, 10, 10)), "test")
    with pytest.raises(TraceFormatError, match="give the decode rate"):
        decode_rate([shrinking])


def test_a_step_table_gives_what_the_trajectories_give_and_can_keep_only_lite(tmp_path: Path) -> None:
    other = [(900, 20, 50), (1300, 80, 52)]
    table = tmp_path / "table.jsonl"
    table.write_text(f"{step_table_line('a', CALLS, lite=True)}\n\n{step_table_line('b', other, lite=False)}\n")
    runs = read_step_table(table)
    assert [r.program_id for r in runs] == ["a", "b"]
    from_trajectory = read_mini_swe_agent_trajectory(write_trajectory(tmp_path, "a", CALLS))
    assert runs[0].program().steps == from_trajectory.program().steps
    assert [r.program_id for r in read_step_table(table, lite_only=True)] == ["a"]


def test_import_mixes_trajectories_and_tables_by_file_name(tmp_path: Path) -> None:
    table = tmp_path / "table.jsonl"
    table.write_text(step_table_line("t", CALLS, lite=True) + "\n")
    runs = import_runs([write_trajectory(tmp_path, "j", CALLS[:2]), table])
    assert [(r.program_id, len(r.calls)) for r in runs] == [("j", 2), ("t", 4)]


def test_an_unknown_trajectory_format_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.traj.json"
    path.write_text(json.dumps({"trajectory_format": "swe-agent-2", "messages": []}))
    with pytest.raises(TraceFormatError, match="swe-agent-2"):
        read_mini_swe_agent_trajectory(path)


def test_an_assistant_message_without_usage_is_named(tmp_path: Path) -> None:
    path = write_trajectory(tmp_path, "u", CALLS)
    data = json.loads(path.read_text())
    del data["messages"][2]["extra"]["response"]["usage"]
    path.write_text(json.dumps(data))
    with pytest.raises(TraceFormatError, match="no extra.response usage"):
        read_mini_swe_agent_trajectory(path)


def test_a_bad_step_table_line_is_named_by_file_and_line(tmp_path: Path) -> None:
    table = tmp_path / "table.jsonl"
    table.write_text(step_table_line("a", CALLS, lite=True) + '\n{"instance_id": "b", "steps": [{"created": 1}]}\n')
    with pytest.raises(TraceFormatError, match=rf"{table}:2: not a step-table run"):
        read_step_table(table)


# --- the recorded SWE-bench Lite runs (package data) ----------------------------------


def test_the_recorded_runs_are_the_93_swe_bench_lite_instances() -> None:
    runs = recorded_swe_lite()
    ids = [p.id for p in runs]
    assert len(ids) == len(set(ids)) == 93
    assert {"astropy__astropy-12907", "django__django-11099", "sympy__sympy-20590"} <= set(ids)
    assert {p.source for p in runs} == {RECORDED_SWE_LITE_SOURCE}


def test_a_recorded_run_keeps_the_usage_the_agent_logged() -> None:
    # astropy__astropy-12907 as its trajectory logged it: 20 calls (model_stats.api_calls),
    # these token sums, and 211 s from the first call's stamp to the last's.
    run = next(p for p in recorded_swe_lite() if p.id == "astropy__astropy-12907")
    assert len(run.steps) == 20
    assert (run.total_prompt_tokens, run.total_completion_tokens) == (258_532, 5_083)
    assert run.steps[0].prompt_tokens == 1662
    # Tool time is what the gaps leave after the answers' generation: less than the span, none at the end.
    assert 0 < sum(s.tool_s for s in run.steps) < 211
    assert run.steps[-1].tool_s == 0.0


def test_the_recorded_runs_hold_numbers_only() -> None:
    data = resources.files("thunderctl.bench") / "data" / RECORDED_SWE_LITE
    lines = gzip.decompress(data.read_bytes()).decode().splitlines()
    assert len(lines) == 93
    for line in lines:
        program = json.loads(line)
        assert set(program) == {"id", "source", "steps"}
        assert re.fullmatch(r"[\w.-]+__[\w.-]+-\d+", program["id"])
        for step in program["steps"]:
            assert set(step) <= {"prompt_tokens", "completion_tokens", "tool_s"}
            assert all(isinstance(value, int | float) for value in step.values())


# --- the gateway's recorder ----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_recorder_writes_a_released_program_as_a_trace_line(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "live.jsonl"
    recorder = TraceRecorder(path, clock)
    recorder.on_request("agent-1")
    clock.now += 0.8
    recorder.on_usage("agent-1", prompt_tokens=1200, completion_tokens=60)
    clock.now += 4.0  # the tool runs
    recorder.on_request("agent-1")
    recorder.on_request("agent-2")  # another program, still open at the end
    clock.now += 0.5
    recorder.on_usage("agent-1", prompt_tokens=1500, completion_tokens=40)
    recorder.on_usage("agent-1", prompt_tokens=0, completion_tokens=0)  # no usage: no step
    recorder.on_end("agent-1")
    recorder.on_end("agent-1")  # release is idempotent
    recorder.on_end("never-seen")
    (program,) = read_trace(path)
    assert program.id == "agent-1" and program.source == "thunderctl gateway"
    assert [(s.prompt_tokens, s.completion_tokens) for s in program.steps] == [(1200, 60), (1500, 40)]
    assert [s.tool_s for s in program.steps] == [pytest.approx(4.0), 0.0]
    recorder.close()  # writes what is still open: agent-2 has no answered step, so nothing
    assert [p.id for p in read_trace(path)] == ["agent-1"]


def test_the_recorder_keeps_unreleased_programs_at_close(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "live.jsonl"
    recorder = TraceRecorder(path, clock)
    recorder.on_request("a")
    recorder.on_usage("a", prompt_tokens=10, completion_tokens=2)
    recorder.close()
    assert [p.id for p in read_trace(path)] == ["a"]
