"""When a program nobody releases ends: the continuation law of docs/scheduler.md ("Ending")."""

from __future__ import annotations

import math
from collections import Counter
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
    (1 − r) / (odds · r) of the gaps, where r is the chance that an answer is continued at all
    (Continuations), a program that ended is `odds` times likelier than one still in its tool
    (odds · r·S(t) < 1 − r, S the gaps' survival). Then its room is not held for it while others
    wait, nor reserved ahead of it. The odds are above even because the two mistakes do not cost
    the same: a live program paused waits in the queue and is re-prefilled, an ended one held
    costs its room only until the next pass.
    """

    floor_s: float
    quantile: float
    margin: float
    unlearnt_s: float
    min_samples: int
    odds: float

    @classmethod
    def from_config(cls, cfg: SchedulerConfig) -> EndingLaw:
        return cls(
            cfg.end_floor_s, cfg.end_quantile, cfg.end_margin, cfg.end_unlearnt_s, cfg.tool_time_min_samples,
            cfg.end_likely_odds,
        )  # fmt: skip

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
        """A test of whether a program is silent so long that it has likely ended (`odds` times
        likelier than not; False before any evidence), made once per pass over the programs.

        Every gap lands in the cluster's samples, so the cluster's threshold bounds every
        program's from below and no key has evidence before the cluster has: it is read once,
        and the many programs heard from more recently are passed over at the cost of a subtraction.
        """
        cluster = tool_times.cluster
        if len(cluster) < self.min_samples:
            return lambda program: False
        share = 1.0 - (1.0 - return_chance) / (self.odds * return_chance)
        # share <= 0: answers are so often the last that silence alone decides.
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


@dataclass
class Continuations:
    """The chance r that an answer is continued, read from the last `window` answers of programs
    nobody released.

    A release says when a program ended, so released ends are not evidence about the silent
    programs: for a client that releases, r stays near 1 and the likely-ended test waits for the
    longest gaps. A continuation is known within its gap, an end only at expiry (margin × the
    longest gap later): counted so, r would read high through every short run and for minutes
    after a load of short programs starts. So each answer open past the end floor also counts
    (the caller's choice of answers), as continued with its posterior chance given its silence,
    and r is the fixed point of that estimate (the EM of a cure-rate model): an answer silent past
    every gap counts as an end at once.
    """

    window: int
    continued: float = 0.0
    ended: float = 0.0

    def observe(self, continued: bool) -> None:
        keep = 1.0 - 1.0 / self.window
        self.continued, self.ended = self.continued * keep, self.ended * keep
        if continued:
            self.continued += 1.0
        else:
            self.ended += 1.0

    def chance(self, survivals: Iterable[float]) -> float:
        """r, given each open answer's survival: the share of the gaps longer than its silence so far."""
        # The survivals are shares of one window of samples: a few hundred values at most.
        counts = Counter(survivals)
        known = self.continued + self.ended + sum(counts.values()) + 2.0  # Laplace's rule: +1 each way
        chance = (self.continued + 1.0) / (self.continued + self.ended + 2.0)
        for _ in range(EM_ITERATIONS):
            expected = sum(n * chance * s / (chance * s + 1.0 - chance) for s, n in counts.items())
            chance, before = (self.continued + expected + 1.0) / known, chance
            if abs(chance - before) < EM_TOLERANCE:
                break
        return chance


EM_ITERATIONS = 100
EM_TOLERANCE = 1e-5


def silent(program: Program) -> bool:
    """No request of it in flight or waiting: only its client can continue it."""
    in_flight = program.phase is Phase.REASONING and program.status is Status.ACTIVE
    return not in_flight and program.waiting_since is None
