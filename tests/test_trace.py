"""Traces: the JSONL format, the importers of mini-swe-agent's logs, and the gateway's recorder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thunderctl.bench.importers import (
    import_traces,
    read_mini_swe_agent_trajectory,
    read_step_table,
)
from thunderctl.bench.trace import (
    TraceFormatError,
    TraceProgram,
    TraceStep,
    read_trace,
    write_trace,
)
from thunderctl.gateway.recorder import TraceRecorder

TRACES = Path(__file__).parents[2] / "shared" / "traces"
STEP_TABLE = TRACES / "mini-swe-agent-gemini3-verified.jsonl"

# Per trajectory: LLM calls, prompt and completion tokens summed over them (the agent's
# own model_stats.api_calls counts the same calls), and seconds from the first to the last call.
RAW = {
    "astropy__astropy-12907": (20, 258_532, 5_083, 211),
    "django__django-11099": (21, 132_644, 3_226, 96),
    "sympy__sympy-20590": (60, 673_987, 5_135, 221),
}


# --- the format ----------------------------------------------------------------------


def test_a_trace_reads_back_what_was_written(tmp_path: Path) -> None:
    programs = [
        TraceProgram(id="a", steps=(TraceStep(prompt_tokens=100, completion_tokens=10, tool_s=1.5),)),
        TraceProgram(
            id="b",
            env_prep_s=12.0,
            source="test",
            steps=(TraceStep(prompt_tokens=50, completion_tokens=5, tool_s=0.5), TraceStep(prompt_tokens=80, completion_tokens=7)),
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
        ('{"id": "x", "steps": [{"prompt_tokens": 5, "completion_tokens": 1, "tool_seconds": 2}]}', "steps.0.tool_seconds"),
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
        id="p", steps=(TraceStep(prompt_tokens=1650, completion_tokens=89, tool_s=3.0), TraceStep(prompt_tokens=2000, completion_tokens=4))
    )
    scaled = program.scaled(0.1)
    assert [(s.prompt_tokens, s.completion_tokens, s.tool_s) for s in scaled.steps] == [(165, 9, 3.0), (200, 1, 0.0)]
    assert scaled.id == "p"


# --- importers -----------------------------------------------------------------------


@pytest.mark.parametrize("instance", sorted(RAW))
def test_a_mini_swe_agent_trajectory_gives_one_step_per_llm_call(instance: str) -> None:
    calls, prompt_tokens, completion_tokens, span_s = RAW[instance]
    program = read_mini_swe_agent_trajectory(TRACES / "raw" / f"{instance}.traj.json")
    assert program.id == instance
    assert len(program.steps) == calls
    assert program.total_prompt_tokens == prompt_tokens
    assert program.total_completion_tokens == completion_tokens
    # Tool times are the gaps between calls: they add up to the run's span, none after the last.
    assert sum(s.tool_s for s in program.steps) == pytest.approx(span_s)
    assert program.steps[-1].tool_s == 0.0
    assert program.steps[0].prompt_tokens < program.steps[-1].prompt_tokens


def test_the_step_table_agrees_with_the_raw_trajectories() -> None:
    table = {p.id: p for p in read_step_table(STEP_TABLE)}
    assert len(table) == 500
    for instance in RAW:
        raw = read_mini_swe_agent_trajectory(TRACES / "raw" / f"{instance}.traj.json")
        assert table[instance].steps == raw.steps


def test_the_lite_runs_are_the_93_swe_bench_lite_instances() -> None:
    lite = read_step_table(STEP_TABLE, lite_only=True)
    assert len(lite) == 93
    assert {"astropy__astropy-12907", "django__django-11099", "sympy__sympy-20590"} <= {p.id for p in lite}


def test_import_mixes_trajectories_and_tables_by_file_name(tmp_path: Path) -> None:
    table = tmp_path / "table.jsonl"
    table.write_text(STEP_TABLE.read_text().splitlines()[0] + "\n")
    programs = import_traces([TRACES / "raw" / "django__django-11099.traj.json", table])
    assert [p.id for p in programs] == ["django__django-11099", "astropy__astropy-12907"]


def test_an_unknown_trajectory_format_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.traj.json"
    path.write_text(json.dumps({"trajectory_format": "swe-agent-2", "messages": []}))
    with pytest.raises(TraceFormatError, match="swe-agent-2"):
        read_mini_swe_agent_trajectory(path)


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
