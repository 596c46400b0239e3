"""When a program nobody releases ends: the continuation law of docs/scheduler.md ("Ending")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from thunderctl.scheduler.program import Phase, Program, Status
from thunderctl.scheduler.retention import GapSamples, ToolTimes


@dataclass(frozen=True)
class EndingLaw:
    """A program is continued within the gaps (answer → its next request) the scheduler has seen,
    or not at all. It is expected back within the `quantile` of the gaps of every key that has
    `min_samples` (its tool kind, itself, the cluster; the longest wins, so a slow tool is waited
    for by its own gaps), and ends once silent `margin` times that, never sooner than `floor_s`
    after its last answer. Before any key has enough gaps, it ends after `unlearnt_s`.
    """

    floor_s: float
    quantile: float
    margin: float
    unlearnt_s: float
    min_samples: int

    def expected_gap_s(self, program: Program, tool_times: ToolTimes) -> float | None:
        """How long after its last answer the program is expected back; None before any evidence."""
        gaps = [samples.quantile(self.quantile) for samples in self._evidence(program, tool_times)]
        return max(gaps) if gaps else None

    def ends_after_s(self, program: Program, tool_times: ToolTimes) -> float:
        """Silence after which the program ends."""
        expected = self.expected_gap_s(program, tool_times)
        return max(self.floor_s, self.unlearnt_s if expected is None else self.margin * expected)

    def overdue(self, program: Program, tool_times: ToolTimes, now: float) -> bool:
        """Silent past its expected gap: not expected back soon, so no room is reserved for it ahead."""
        expected = self.expected_gap_s(program, tool_times)
        return expected is not None and silent(program) and now - program.last_activity > expected

    def _evidence(self, program: Program, tool_times: ToolTimes) -> Iterator[GapSamples]:
        keys = [tool_times.cluster, tool_times.by_program.get(program.id)]
        if program.tool is not None:
            keys.append(tool_times.by_tool.get(program.tool))
        return (samples for samples in keys if samples is not None and len(samples) >= self.min_samples)


def silent(program: Program) -> bool:
    """No request of it in flight or waiting: only its client can continue it."""
    in_flight = program.phase is Phase.REASONING and program.status is Status.ACTIVE
    return not in_flight and program.waiting_since is None
