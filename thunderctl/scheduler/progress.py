"""Whose wait to cut: the programs nearest their end first (docs/admission.md, "Nearest the end
first"). Pure: fed the lengths of the programs that ended and the steps of those still running,
asked how far from its end one is."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable

from thunderctl.scheduler.config import SchedulerConfig
from thunderctl.scheduler.program import Program


class ProgramLengths:
    """How many steps a program has left, expected from the lengths L (answered requests) of the
    programs that ended lately and the steps of those still running (each a length known only to
    be at least its steps so far): E[L − s | L > s] of their product-limit (Kaplan–Meier)
    estimate, up to the longest length seen. A run shorter than most programs is so not read as
    one of short programs only, and the law acts before any program has ended."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._ended: deque[int] = deque()
        self._running: list[int] = []
        self._left: list[float] | None = None  # steps left, by steps done (to the longest seen)

    def observe(self, steps: int) -> None:
        """A program ended after `steps` answered requests (0: it never ran; not counted)."""
        if steps <= 0:
            return
        self._ended.append(steps)
        if len(self._ended) > self.config.waits.nearest_end_window:
            self._ended.popleft()
        self._left = None

    def snapshot(self) -> list[int]:
        """The lengths of the programs that ended lately (those running are surveyed again)."""
        return list(self._ended)

    def restore(self, ended: list[int]) -> None:
        self._ended = deque(ended[-self.config.waits.nearest_end_window :])
        self._left = None

    def survey(self, running_steps: Iterable[int]) -> None:
        """The steps of every program still running (the policy's tick); those of none yet are no evidence."""
        self._running = sorted(s for s in running_steps if s > 0)
        self._left = None

    def remaining_share(self, steps: int) -> float | None:
        """The steps a program `steps` in is expected to have left, as a share (0-1) of what a
        fresh program has; None with fewer than `nearest_end_min_samples` programs seen. One as
        old as the oldest seen is taken as at its end (0)."""
        if len(self._ended) + len(self._running) < self.config.waits.nearest_end_min_samples:
            return None
        if self._left is None:
            self._left = self._steps_left()
        if not self._left or self._left[0] <= 0:
            return None
        left = self._left[steps] if steps < len(self._left) else 0.0
        return min(left / self._left[0], 1.0)

    def queue_delay_s(self, program: Program) -> float:
        """How far behind a program expected to end now this one queues: `nearest_end_s` times
        its expected share left (0 with the setting off or before any evidence)."""
        span = self.config.waits.nearest_end_s
        share = self.remaining_share(program.steps) if span is not None else None
        return 0.0 if span is None or share is None else span * share

    def _steps_left(self) -> list[float]:
        return steps_left(sorted(self._ended), self._running)

    def left_after(self, steps: int) -> float:
        """E[L − s | L > s] at s = `steps` (0 past the longest length seen, or with nothing seen)."""
        if self._left is None:
            self._left = self._steps_left()
        return self._left[steps] if steps < len(self._left) else 0.0


def steps_left(ended: list[int], running: list[int], tail: Callable[[int], float] | None = None) -> list[float]:
    """E[L − s | L > s] for s = 0 … the longest length seen, of the product-limit (Kaplan–Meier)
    estimate over `ended` lengths and `running` steps (each a length known to be at least it), both
    sorted. `tail(n)` is the steps expected after n of a program still running at the longest
    length n seen (another law's, for a few samples whose longest is still running); none: 0."""
    longest = max(ended[-1] if ended else 0, running[-1] if running else 0)
    survival = [1.0] * (longest + 1)  # P(L > k)
    for k in range(1, longest + 1):
        at_risk = len(ended) - bisect.bisect_left(ended, k) + len(running) - bisect.bisect_left(running, k)
        ending = bisect.bisect_right(ended, k) - bisect.bisect_left(ended, k)
        survival[k] = survival[k - 1] * (1.0 - ending / at_risk) if at_risk else 0.0
    # Σ_{k > longest} P(L > k): past the longest seen, P(L > k) = P(L > longest) × the tail law's.
    beyond = survival[longest] * max(tail(longest) - 1.0, 0.0) if tail is not None else 0.0
    left, total = [0.0] * (longest + 1), beyond
    for s in range(longest, -1, -1):  # E[L − s | L > s] = Σ_{k ≥ s} P(L > k) / P(L > s)
        total += survival[s]
        left[s] = total / survival[s] if survival[s] > 0 else 0.0
    return left
