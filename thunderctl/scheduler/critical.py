"""The critical path first while a batch runs (docs/admission.md, "The critical path first").

A batch ends when its last program does, so the programs with the most work left are its critical
path: the longest-processing-time-first rule of makespan scheduling. A program's work left is the
steps it is expected to have left times its own pace. Its steps left are read from its group (the
samples of one task, whose lengths go together far more than different tasks' do): the group's
product-limit law over the lengths of its samples that ended and the steps of those running, and
past the group's longest, the cluster's law (progress.py). Pure: it reads the group book, the
programs and the time it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from thunderctl.scheduler.groups import GroupBook
from thunderctl.scheduler.program import Program
from thunderctl.scheduler.progress import ProgramLengths, steps_left

Held = TypeVar("Held")

# The share of a batch's held programs, those with the most work left, that priced retention
# leaves alone. Of a half, a quarter and a tenth on the simulator's twelve batches a quarter
# shortened them most on the mean and lengthened none by more than 3 %
# (docs/evidence/rollout-critical-path.md).
PROTECTED_SHARE = 0.25


class WorkLeft:
    """Each batch program's expected seconds of work left (None for one in no group)."""

    def __init__(self, groups: GroupBook, lengths: ProgramLengths, programs: Mapping[str, Program]) -> None:
        self.groups = groups
        self.lengths = lengths
        self.programs = programs
        # A pass asks of every ACTING program of a worker at one instant: each group's law once then,
        # and only that instant's laws kept (groups come and go).
        self._read_at: float | None = None
        self._laws: dict[str, tuple[list[float], float | None]] = {}

    def seconds(self, program: Program, now: float) -> float | None:
        group_id = program.group
        if group_id is None or group_id not in self.groups.groups:
            return None
        if self._read_at != now:
            self._read_at, self._laws = now, {}
        law = self._laws.get(group_id)
        if law is None:
            law = self._laws[group_id] = self._group_law(group_id, now)
        left, group_pace = law
        steps = left[program.steps] if program.steps < len(left) else self.lengths.left_after(program.steps)
        pace = active_pace(program, now) if program.steps else group_pace
        return steps * (pace if pace is not None else 1.0)

    def priced(self, held: Sequence[tuple[Program, Held]], now: float) -> list[tuple[Program, Held]]:
        """The held programs priced retention may drop: all but the batch programs in the top
        PROTECTED_SHARE of work left, whose re-prefill and wait would land on the batch's end."""
        left = {program.id: self.seconds(program, now) for program, _ in held}
        batch = sorted(seconds for seconds in left.values() if seconds is not None)
        if not batch:
            return list(held)
        cut = batch[min(int(len(batch) * (1.0 - PROTECTED_SHARE)), len(batch) - 1)]
        return [(p, rest) for p, rest in held if (seconds := left[p.id]) is None or seconds < cut]

    def _group_law(self, group_id: str, now: float) -> tuple[list[float], float | None]:
        group = self.groups.groups[group_id]
        members = [self.programs[i] for i in group.live if i in self.programs]
        running = sorted(p.steps for p in members if p.steps)
        paces = [pace for p in members if p.steps and (pace := active_pace(p, now)) is not None]
        return steps_left(group.lengths, running, self.lengths.left_after), (sum(paces) / len(paces) if paces else None)


def active_pace(program: Program, now: float) -> float | None:
    """Seconds a step has taken it, its pauses left out (None before its first answer)."""
    if not program.steps:
        return None
    paused = program.paused_total_s + (now - program.paused_at if program.paused_at is not None else 0.0)
    return max(now - program.created_at - paused, 0.0) / program.steps
