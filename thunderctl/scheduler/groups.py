"""Groups of programs (a GRPO group: the G samples of one task) and the head start that finishes
a batch sooner (docs/admission.md, "Groups").

A program names its group once (its first request that names one); the book counts each group's
programs that ended (released or expired) against all it has seen, for `status` and `/programs`.
Pure and synchronous, as the policy is.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from thunderctl.scheduler.config import SchedulerConfig
from thunderctl.scheduler.program import Program


@dataclass
class Group:
    id: str
    live: set[str] = field(default_factory=set)  # its programs that have not ended
    done: int = 0  # its programs that ended
    lengths: list[int] = field(default_factory=list)  # the steps of those that ended, sorted

    @property
    def total(self) -> int:
        return self.done + len(self.live)

    @property
    def progress(self) -> float:
        """The share of its programs that ended (0 for a group nobody finished)."""
        return self.done / self.total if self.total else 0.0


class GroupBook:
    """Every group with a live program, and the last `remembered` groups whose programs all ended
    (a sample that starts after its group's others ended still counts with them)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.groups: OrderedDict[str, Group] = OrderedDict()

    def join(self, program: Program, group_id: str | None) -> None:
        """The program's request named `group_id`: the program belongs to it from now on (its first
        group stays: a program is one sample of one task)."""
        if group_id is None or program.group is not None:
            return
        program.group = group_id
        group = self.groups.setdefault(group_id, Group(group_id))
        group.live.add(program.id)
        self.groups.move_to_end(group_id)

    def end(self, program: Program) -> None:
        """The program ended (released or expired): one more of its group is done."""
        group = self.groups.get(program.group or "")
        if group is None or program.id not in group.live:
            return
        group.live.discard(program.id)
        group.done += 1
        bisect.insort(group.lengths, program.steps)
        self._forget_finished()

    def snapshot(self) -> list[list[Any]]:
        """[id, live programs, programs ended, their lengths] of each group kept, the least recently
        joined first."""
        return [[g.id, sorted(g.live), g.done, g.lengths] for g in self.groups.values()]

    def restore(self, groups: list[list[Any]]) -> None:
        """Groups as `snapshot` gave them (a journal written before lengths were kept has none)."""
        self.groups = OrderedDict()
        for group_id, live, done, *lengths in groups:
            self.groups[group_id] = Group(group_id, set(live), done, sorted(lengths[0]) if lengths else [])

    def counts(self) -> list[tuple[str, int, int]]:
        """(group id, programs ended, programs seen) of every group kept, the nearest done first."""
        ordered = sorted(self.groups.values(), key=lambda g: (not g.live, -g.progress, g.id))
        return [(g.id, g.done, g.total) for g in ordered]

    def _forget_finished(self) -> None:
        if len(self.groups) <= self.config.groups_remembered:
            return
        finished = [g.id for g in self.groups.values() if not g.live]
        for group_id in finished[: max(0, len(finished) - self.config.groups_remembered)]:
            del self.groups[group_id]
