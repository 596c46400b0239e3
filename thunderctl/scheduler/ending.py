"""When a program nobody releases ends: the continuation law of docs/scheduler.md ("Ending")."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from thunderctl.scheduler.config import SchedulerConfig
from thunderctl.scheduler.program import Phase, Program, Status
from thunderctl.scheduler.retention import GapSamples, ToolTimes


@dataclass(frozen=True)
class EndingLaw:
    """A program is continued within the gaps (answer → its next request) the scheduler has seen,
    or not at all. It is expected back within the `quantile` of the gaps of every key that has
    `min_samples` (its tool kind, itself, the cluster's longer `tail` window; the longest wins, so
    a slow tool is waited for by its own gaps), and ends once silent `margin` times that, never sooner than `floor_s`
    after its last answer. Before any key has enough gaps, it ends after `unlearnt_s`.

    Long before that it is *likely ended*: once its silence is longer than all but a share
    (1 − r) / r of the gaps, where r is the chance that an answer is continued at all, a program
    that ended is more likely than one still in its tool (r·S(t) < 1 − r, S the gaps' survival).
    Then its room is not held for it while others wait, nor reserved ahead of it.
    """

    floor_s: float
    quantile: float
    margin: float
    unlearnt_s: float
    min_samples: int

    @classmethod
    def from_config(cls, cfg: SchedulerConfig) -> EndingLaw:
        return cls(cfg.end_floor_s, cfg.end_quantile, cfg.end_margin, cfg.end_unlearnt_s, cfg.tool_time_min_samples)

    def ended(self, programs: Iterable[Program], tool_times: ToolTimes, now: float) -> Iterator[Program]:
        """The programs not continued within the law: they end, as a release ends them."""
        # No program ends within the floor: most are that recent, and their law is not read.
        return (
            p
            for p in programs
            if now - p.last_activity > self.floor_s
            and silent(p)
            and now - p.last_activity > self.ends_after_s(p, tool_times)
        )

    def ends_after_s(self, program: Program, tool_times: ToolTimes) -> float:
        """Silence after which the program ends."""
        gaps = [samples.quantile(self.quantile) for samples in self._evidence(program, tool_times, tool_times.tail)]
        return max(self.floor_s, self.margin * max(gaps) if gaps else self.unlearnt_s)

    def likely_ended(self, tool_times: ToolTimes, return_chance: float, now: float) -> Callable[[Program], bool]:
        """A test of whether a program is silent so long that it has more likely ended than not
        (False before any evidence), made once per pass over the programs.

        Every gap lands in the cluster's samples, so the cluster's threshold bounds every
        program's from below and no key has evidence before the cluster has: it is read once,
        and the many programs heard from more recently are passed over at the cost of a subtraction.
        """
        cluster = tool_times.cluster
        if len(cluster) < self.min_samples:
            return lambda program: False
        share = 1.0 - (1.0 - return_chance) / return_chance
        # share <= 0: answers are more often the last than continued, so silence alone decides.
        floor = cluster.quantile(share) if share > 0 else -math.inf

        def test(program: Program) -> bool:
            silence = now - program.last_activity
            if silence <= floor or not silent(program):
                return False
            evidence = self._evidence(program, tool_times, cluster)
            return share <= 0 or silence > max(samples.quantile(share) for samples in evidence)

        return test

    def _evidence(self, program: Program, tool_times: ToolTimes, cluster: GapSamples) -> Iterator[GapSamples]:
        keys = [cluster, tool_times.by_program.get(program.id)]
        if program.tool is not None:
            keys.append(tool_times.by_tool.get(program.tool))
        return (samples for samples in keys if samples is not None and len(samples) >= self.min_samples)


def silent(program: Program) -> bool:
    """No request of it in flight or waiting: only its client can continue it."""
    in_flight = program.phase is Phase.REASONING and program.status is Status.ACTIVE
    return not in_flight and program.waiting_since is None
