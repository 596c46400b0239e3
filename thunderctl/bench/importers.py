"""Traces from what agents leave behind: mini-swe-agent trajectories and step tables.

Both sources give per LLM call the engine's usage and a `created` time stamp in whole
seconds. The gap between two calls' stamps holds the tool's time *and* the model's own time,
so `tool_s` taken from it bounds the tool time from above; `--time-scale` shrinks it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thunderctl.bench.trace import TraceFormatError, TraceProgram, TraceStep

MINI_SWE_AGENT_FORMAT = "mini-swe-agent-1"


@dataclass(frozen=True)
class CallUsage:
    """One LLM call as the agent logged it."""

    prompt_tokens: int
    completion_tokens: int
    created: float


def program_from_calls(program_id: str, calls: Sequence[CallUsage], source: str) -> TraceProgram:
    if not calls:
        raise TraceFormatError(f"{program_id}: no LLM calls with usage")
    gaps = [max(0.0, later.created - earlier.created) for earlier, later in itertools.pairwise(calls)]
    steps = tuple(
        TraceStep(prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens, tool_s=tool_s)
        for call, tool_s in zip(calls, [*gaps, 0.0])
    )
    return TraceProgram(id=program_id, steps=steps, source=source)


def read_mini_swe_agent_trajectory(path: Path) -> TraceProgram:
    """A mini-swe-agent v1 `.traj.json`: one step per assistant message with usage."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("trajectory_format") != MINI_SWE_AGENT_FORMAT:
        found = data.get("trajectory_format") if isinstance(data, dict) else type(data).__name__
        raise TraceFormatError(f"{path}: not a {MINI_SWE_AGENT_FORMAT} trajectory (trajectory_format {found!r})")
    calls = [call_of_message(message, path) for message in data.get("messages", []) if message.get("role") == "assistant"]
    program_id = data.get("instance_id") or path.name.removesuffix(".traj.json")
    return program_from_calls(program_id, calls, "mini-swe-agent")


def call_of_message(message: dict[str, Any], path: Path) -> CallUsage:
    response = (message.get("extra") or {}).get("response") or {}
    usage = response.get("usage")
    if not usage or "created" not in response:
        raise TraceFormatError(f"{path}: an assistant message has no extra.response usage and created time")
    return CallUsage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]), float(response["created"]))


def read_step_table(path: Path, *, lite_only: bool = False) -> list[TraceProgram]:
    """The step table (one run per line: instance_id, lite, steps with usage and created)."""
    programs = []
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
            programs.append(program_from_calls(program_id, calls, "mini-swe-agent step table"))
    return programs


def import_traces(paths: Sequence[Path], *, lite_only: bool = False) -> list[TraceProgram]:
    """Programs from any mix of `.traj.json` files and step tables (by file name)."""
    programs: list[TraceProgram] = []
    for path in paths:
        if path.name.endswith(".traj.json"):
            programs.append(read_mini_swe_agent_trajectory(path))
        else:
            programs.extend(read_step_table(path, lite_only=lite_only))
    return programs
