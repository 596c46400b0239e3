"""The scheduler's state as plain data, for a daemon that must come back with its programs
(`Scheduler.snapshot`, `Scheduler.restore`; the daemon's journal stores it). Pure: JSON-ready
dicts and lists, times in the scheduler's clock."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any

from thunderctl.scheduler.program import Phase, Program, Status

# A program's moments, in the scheduler's clock: moved together when it is restored under another.
PROGRAM_TIMES = ("created_at", "last_activity", "acting_since", "paused_at", "waiting_since", "responded_at")
PROGRAM_FIELDS = tuple(f.name for f in fields(Program))
# A program's fields as one tuple: a program whose state is the one a snapshot took has not changed
# since. Its tool times change only when it leaves a tool call, and its phase does then too.
program_state = operator.attrgetter(*PROGRAM_FIELDS)


@dataclass
class SchedulerSnapshot:
    """Every live program and what the laws learnt, at `taken_at` (the scheduler's clock)."""

    taken_at: float
    # Each program's fields (Program), and its own tool times under "gaps", the oldest first.
    programs: list[dict[str, Any]]
    # What the laws learnt: tool times (cluster, tail, tool kinds), the ending law's counts, the
    # admission law's rung and measurements, the recent lengths, the groups, the counters.
    learnt: dict[str, Any]
    # Each live program's `program_state` when taken: a later snapshot `since` these holds only the
    # programs changed meanwhile in `programs`.
    states: dict[str, tuple[Any, ...]] = field(default_factory=dict, compare=False)


def program_record(program: Program, gaps: list[float]) -> dict[str, Any]:
    """The program as plain data (its phase and status as their values), with its tool times."""
    record = {name: getattr(program, name) for name in PROGRAM_FIELDS}
    record["phase"], record["status"] = program.phase.value, program.status.value
    record["gaps"] = gaps
    return record


def program_from_record(record: dict[str, Any], shift_s: float) -> tuple[Program, list[float]]:
    """The program a record holds, its times moved by `shift_s`, and its tool times."""
    values = {name: record[name] for name in PROGRAM_FIELDS}
    values["phase"], values["status"] = Phase(values["phase"]), Status(values["status"])
    for name in PROGRAM_TIMES:
        if values[name] is not None:
            values[name] += shift_s
    return Program(**values), list(record["gaps"])
