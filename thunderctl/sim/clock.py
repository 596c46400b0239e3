"""A virtual clock with a queue of timed actions: the simulator's only notion of time."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

Action = Callable[[], None]


@dataclass
class VirtualClock:
    """Actions run in time order, ties in the order they were scheduled. Calling the clock
    gives the current time, so it can be the scheduler's injected clock."""

    now: float = 0.0
    _queue: list[tuple[float, int, Action]] = field(default_factory=list)
    _scheduled: int = 0

    def __call__(self) -> float:
        return self.now

    def at(self, time_s: float, action: Action) -> None:
        if time_s < self.now:
            raise ValueError(f"cannot schedule at {time_s} s, the clock is at {self.now} s")
        self._scheduled += 1
        heapq.heappush(self._queue, (time_s, self._scheduled, action))

    def after(self, seconds: float, action: Action) -> None:
        self.at(self.now + seconds, action)

    def run_until(self, end_s: float) -> None:
        """Run every action due up to `end_s`, then stand at `end_s`."""
        queue = self._queue
        while queue and queue[0][0] <= end_s:
            time_s, _, action = heapq.heappop(queue)
            self.now = time_s
            action()
        self.now = max(self.now, end_s)
