"""Traces from what agents leave behind: mini-swe-agent trajectories and step tables.

Both sources give per LLM call the engine's usage and a `created` time stamp in whole
seconds, taken when the call was made: the gap from one call's stamp to the next holds that
call's own generation, the tool's time and the agent's. The replay generates every answer for
real, so sleeping the whole gap would count the recorded model's generation twice; given the
recorded model's decode rate, each gap loses its answer's generation time (`decode_rate`
fits that rate to the runs). What is left still holds the model's time to first token, so
`tool_s` bounds the tool time from above.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thunderctl.traceformat import TraceFormatError, TraceProgram, TraceStep

MINI_SWE_AGENT_FORMAT = "mini-swe-agent-1"
STEP_TABLE_SOURCE = "mini-swe-agent step table"


@dataclass(frozen=True)
class CallUsage:
    """One LLM call as the agent logged it."""

    prompt_tokens: int
    completion_tokens: int
    created: float


@dataclass(frozen=True)
class AgentRun:
    """One agent run as logged: its LLM calls in order."""

    program_id: str
    calls: tuple[CallUsage, ...]
    source: str

    def gaps(self) -> list[tuple[CallUsage, float]]:
        """Each call but the last, with the seconds from its stamp to the next call's."""
        return [
            (earlier, max(0.0, later.created - earlier.created)) for earlier, later in itertools.pairwise(self.calls)
        ]

    def program(self, decode_tokens_per_s: float | None = None) -> TraceProgram:
        """The run as a trace program; with a decode rate, each gap less its answer's generation."""
        if not self.calls:
            raise TraceFormatError(f"{self.program_id}: no LLM calls with usage")
        tools = [
            max(0.0, gap - (call.completion_tokens / decode_tokens_per_s if decode_tokens_per_s else 0.0))
            for call, gap in self.gaps()
        ]
        steps = tuple(
            TraceStep(
                prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens, tool_s=round(tool_s, 2)
            )
            for call, tool_s in zip(self.calls, [*tools, 0.0])
        )
        return TraceProgram(id=self.program_id, steps=steps, source=self.source)


def decode_rate(runs: Sequence[AgentRun]) -> float:
    """The recorded model's decode rate (tokens/s): the inverse slope of a least-squares line
    through (answer tokens, gap after it) over every step of the runs."""
    pairs = [(call.completion_tokens, gap) for run in runs for call, gap in run.gaps()]
    if len({tokens for tokens, _ in pairs}) < 2:
        raise TraceFormatError("fitting a decode rate needs gaps after answers of at least two lengths")
    slope, _ = statistics.linear_regression(*zip(*pairs))
    if slope <= 0:
        raise TraceFormatError(
            f"the gaps do not grow with the answers' length (slope {slope:.3g} s/token): give the decode rate instead"
        )
    return 1.0 / slope


def read_mini_swe_agent_trajectory(path: Path) -> AgentRun:
    """A mini-swe-agent v1 `.traj.json`: one call per assistant message with usage."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("trajectory_format") != MINI_SWE_AGENT_FORMAT:
        found = data.get("trajectory_format") if isinstance(data, dict) else type(data).__name__
        raise TraceFormatError(f"{path}: not a {MINI_SWE_AGENT_FORMAT} trajectory (trajectory_format {found!r})")
    calls = [
        call_of_message(message, path) for message in data.get("messages", []) if message.get("role") == "assistant"
    ]
    program_id = data.get("instance_id") or path.name.removesuffix(".traj.json")
    return AgentRun(program_id, tuple(calls), "mini-swe-agent")


def call_of_message(message: dict[str, Any], path: Path) -> CallUsage:
    response = (message.get("extra") or {}).get("response") or {}
    usage = response.get("usage")
    if not usage or "created" not in response:
        raise TraceFormatError(f"{path}: an assistant message has no extra.response usage and created time")
    return CallUsage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]), float(response["created"]))


def read_step_table(path: Path, *, lite_only: bool = False, source: str = STEP_TABLE_SOURCE) -> list[AgentRun]:
    """The step table (one run per line: instance_id, lite, steps with usage and created)."""
    runs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                run = json.loads(line)
                calls = [CallUsage(s["prompt_tokens"], s["completion_tokens"], s["created"]) for s in run["steps"]]
                program_id = run["instance_id"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise TraceFormatError(f"{path}:{number}: not a step-table run ({exc!r})") from None
            if lite_only and not run.get("lite"):
                continue
            runs.append(AgentRun(program_id, tuple(calls), source))
    return runs


def import_runs(paths: Sequence[Path], *, lite_only: bool = False) -> list[AgentRun]:
    """Runs from any mix of `.traj.json` files and step tables (by file name)."""
    runs: list[AgentRun] = []
    for path in paths:
        if path.name.endswith(".traj.json"):
            runs.append(read_mini_swe_agent_trajectory(path))
        else:
            runs.extend(read_step_table(path, lite_only=lite_only))
    return runs
