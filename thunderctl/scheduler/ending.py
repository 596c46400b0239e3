"""When a program nobody releases ends: the continuation law of docs/scheduler.md ("Ending")."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from thunderctl.scheduler.config import SchedulerConfig
from thunderctl.scheduler.program import Phase, Program, Status
from thunderctl.scheduler.retention import MAX_TOOL_KINDS, GapSamples, ToolTimes


@dataclass(frozen=True)
class EndChances:
    """The chance q that a silent program's last answer was its last: the share of unreleased
    programs' answers not continued (1 − r, Continuations), times how much likelier than the mean
    an answer of its kind ends its program (AnswerKinds)."""

    mean: float
    ratios: Mapping[str | None, float] = field(default_factory=dict)

    def of(self, kind: str | None) -> float:
        return min(1.0, self.mean * self.ratios.get(kind, 1.0))

    @cached_property
    def highest(self) -> float:
        return min(1.0, self.mean * max((1.0, *self.ratios.values())))


@dataclass(frozen=True)
class LikelyEnded:
    """EndingLaw.likely_ended's test; no program silent for `floor` seconds or less has likely ended."""

    floor: float
    test: Callable[[Program], bool]

    def __call__(self, program: Program) -> bool:
        return self.test(program)


@dataclass
class EndingLaw:
    """A program is continued within the gaps (answer → its next request) the scheduler has seen,
    or not at all. It is expected back within the `quantile` of the gaps of every key that has
    `min_samples` (its tool kind, itself, the cluster's longer `tail` window; the longest wins, so
    a slow tool is waited for by its own gaps), and ends once silent `margin` times that, never sooner than `floor_s`
    after its last answer. Before any key has enough gaps, it ends after `unlearnt_s`.

    Long before that it is *likely ended*: once its silence is longer than all but a share
    q / (odds · (1 − q)) of the gaps, where q is the chance that its last answer was its last
    (EndChances), a program that ended is `odds` times likelier than one still in its tool
    (odds · (1 − q)·S(t) < q, S the gaps' survival). Then its room is not held for it while others
    wait, nor reserved ahead of it. The odds are above even because the two mistakes do not cost
    the same: a live program paused waits in the queue and is re-prefilled, an ended one held
    costs its room only until the next pass.

    It learns q from the programs' events (`on_request`, `on_end`, `expired`); q walks every
    program and every request asks for it while others wait, so it is read at most once every
    `read_every_s` (a tick interval): it moves slowly.
    """

    floor_s: float
    quantile: float
    margin: float
    unlearnt_s: float
    min_samples: int
    odds: float
    read_every_s: float
    continuations: Continuations
    answer_kinds: AnswerKinds
    _read: tuple[float, EndChances] = (-math.inf, EndChances(0.0))  # (read at, chances)

    @classmethod
    def from_config(cls, cfg: SchedulerConfig) -> EndingLaw:
        ending = cfg.ending
        return cls(
            ending.floor_s, ending.quantile, ending.margin, ending.unlearnt_s, cfg.retention.tool_time_min_samples,
            ending.likely_odds, cfg.tick_interval_s, Continuations(ending.chance_window),
            AnswerKinds(ending.chance_window),
        )  # fmt: skip

    def on_request(self, program: Program) -> None:
        """The program's next request (before retention reads its answer's gap): its answer was continued."""
        if program.responded_at is not None:
            self.continuations.observe(continued=True)
            self.answer_kinds.observe(program.tool, ended=False)

    def on_end(self, program: Program) -> None:
        """Released or expired: a silent program's last answer was its last."""
        if program.responded_at is not None and silent(program):
            self.answer_kinds.observe(program.tool, ended=True)

    def expired(self, programs: Iterable[Program], tool_times: ToolTimes, now: float) -> Iterator[Program]:
        """The programs that end now, one at a time: the caller ends each before the next is judged
        (an ended child makes its parent heard from)."""
        for program in self.ended(programs, tool_times, now):
            if program.responded_at is not None:
                self.continuations.observe(continued=False)
            yield program

    def snapshot(self) -> dict[str, Any]:
        return {
            "continuations": [self.continuations.continued, self.continuations.ended],
            "answer_kinds": self.answer_kinds.snapshot(),
        }

    def restore(self, learnt: dict[str, Any]) -> None:
        self.continuations.continued, self.continuations.ended = learnt["continuations"]
        self.answer_kinds.restore(learnt["answer_kinds"])

    def chances(self, programs: Iterable[Program], tool_times: ToolTimes, now: float) -> EndChances:
        """The chance a silent program's last answer was its last: that an unreleased program's answer
        is not continued, given every open answer's silence (Continuations), by the answer's kind
        (AnswerKinds)."""
        read_at, chances = self._read
        if now - read_at < self.read_every_s:
            return chances
        gaps = tool_times.cluster
        # A silence within the floor is no evidence of an end (no program ends within it): the gaps
        # seen first are the short ones, and live programs in longer tools would look past them all.
        survivals = [
            gaps.survival(now - p.responded_at)
            for p in programs
            if len(gaps) and p.responded_at is not None and now - p.responded_at > self.floor_s and silent(p)
        ]
        chances = EndChances(1.0 - self.continuations.chance(survivals), self.answer_kinds.ratios())
        self._read = (now, chances)
        return chances

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

    def likely_ended(self, programs: Iterable[Program], tool_times: ToolTimes, now: float) -> LikelyEnded:
        """A test of whether a program is silent so long that it has likely ended (`odds` times
        likelier than not; False before any evidence), made once per pass over the programs.

        Every gap lands in the cluster's samples, so the cluster's threshold at the highest end
        chance bounds every program's from below and no key has evidence before the cluster has:
        it is read once, as the test's `floor`, and a pass need not look at the many programs
        heard from more recently.
        """
        ends = self.chances(programs, tool_times, now)
        cluster = tool_times.cluster
        if len(cluster) < self.min_samples:
            return LikelyEnded(math.inf, lambda program: False)
        lowest = self._share(ends.highest)
        floor = cluster.quantile(lowest) if lowest > 0 else -math.inf

        def test(program: Program) -> bool:
            silence = now - program.last_activity
            if silence <= floor or not silent(program):
                return False
            share = self._share(ends.of(program.tool))
            evidence = self._evidence(program, tool_times, cluster)
            return share <= 0 or silence > max(samples.quantile(share) for samples in evidence)

        return LikelyEnded(floor, test)

    def _share(self, end_chance: float) -> float:
        """The share of the gaps a silence must outlast for an end at this chance to be `odds` times
        likelier than a tool; <= 0 where answers are so often the last that silence alone decides."""
        return 1.0 - end_chance / (self.odds * (1.0 - end_chance)) if end_chance < 1.0 else -math.inf

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


@dataclass
class AnswerKinds:
    """How often each kind of answer (the tool it calls, or None) was its program's last, over
    about the last `window` answers whose fate is known, released programs' included.

    Which answers end programs is the same whether the client releases or not: an OpenAI
    tool-calling loop ends on an answer that calls no tool, SWE-agent on `submit`, OpenHands on
    `finish`. So released programs teach it to the gateway, and the programs nobody releases
    are read by it: a silence after an answer that always ends a program is an end at once, one
    after a tool that never does is a tool call. A kind's share is drawn towards the mean by
    `END_KIND_PRIOR` answers, so a kind seen a few times reads as average.
    """

    window: int
    answers: float = 0.0
    ends: float = 0.0
    _kinds: dict[str | None, tuple[float, float, int]] = field(default_factory=dict)  # answers, ends, at answer no.
    _seen: int = 0  # answers observed: each kind's counts are decayed from the answer they were last updated at

    def observe(self, kind: str | None, ended: bool) -> None:
        keep = 1.0 - 1.0 / self.window
        self.answers, self.ends = self.answers * keep + 1.0, self.ends * keep + ended
        answers, ends = self._decayed(kind)
        self._seen += 1
        self._kinds.pop(kind, None)
        self._kinds[kind] = (answers * keep + 1.0, ends * keep + ended, self._seen)  # the last key: the most recent
        if len(self._kinds) > MAX_TOOL_KINDS:
            del self._kinds[next(iter(self._kinds))]

    def ratios(self) -> dict[str | None, float]:
        """Each kind's end share over the mean's; an unseen kind's is 1."""
        if self.ends <= 0.0:
            return {}
        mean = self.ends / self.answers
        ratios = {}
        for kind in self._kinds:
            answers, ends = self._decayed(kind)
            ratios[kind] = (ends + END_KIND_PRIOR * mean) / ((answers + END_KIND_PRIOR) * mean)
        return ratios

    def snapshot(self) -> dict[str, Any]:
        """What it counted, JSON-ready (a kind may be None: the kinds go as a list)."""
        kinds = [[kind, *counts] for kind, counts in self._kinds.items()]
        return {"answers": self.answers, "ends": self.ends, "seen": self._seen, "kinds": kinds}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.answers, self.ends, self._seen = snapshot["answers"], snapshot["ends"], snapshot["seen"]
        self._kinds = {kind: (answers, ends, at) for kind, answers, ends, at in snapshot["kinds"][-MAX_TOOL_KINDS:]}

    def _decayed(self, kind: str | None) -> tuple[float, float]:
        answers, ends, at = self._kinds.get(kind, (0.0, 0.0, self._seen))
        keep = (1.0 - 1.0 / self.window) ** (self._seen - at)
        return answers * keep, ends * keep


# Answers of pseudo-evidence at the mean end share a kind's own share is drawn towards.
END_KIND_PRIOR = 8.0


EM_ITERATIONS = 100
EM_TOLERANCE = 1e-5


def silent(program: Program) -> bool:
    """No request of it in flight or waiting, and no child of it live: only its client can continue it."""
    in_flight = program.phase is Phase.REASONING and program.status is Status.ACTIVE
    return not in_flight and program.waiting_since is None and program.children == 0
