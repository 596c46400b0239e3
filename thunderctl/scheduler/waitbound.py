"""The wait bound: how long a waiting request may wait before ACTING programs pause for it.

A fixed bound (400 s) is right for no load in particular: where programs wait seconds it never
acts and a few programs wait 400 s while the median waits 20; where everybody waits minutes it
acts on half the queue. The bound follows what waiting programs see instead: `factor` times
the median of the recent admission waits (of requests that waited at all), between a floor and
a ceiling. docs/admission.md, "The wait bound", has the law and why it is stable.
"""

from __future__ import annotations

import statistics
from collections import deque

from thunderctl.scheduler.config import SchedulerConfig


class WaitBound:
    """Recent admission waits, and the bound they give; pure, fed by the policy."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waits: deque[float] = deque(maxlen=config.wait_bound_window)

    def observe(self, wait_s: float) -> None:
        """A waiting request was admitted after `wait_s` seconds (0: it never waited; not counted)."""
        if wait_s > 0:
            self._waits.append(wait_s)

    @property
    def median_s(self) -> float | None:
        """The median recent wait, once there are enough of them to trust."""
        if len(self._waits) < self.config.wait_bound_min_samples:
            return None
        return statistics.median(self._waits)

    @property
    def seconds(self) -> float | None:
        """The bound now; None: no bound (only the forced resume ends a wait)."""
        cfg = self.config
        if cfg.wait_bound_s is None:
            return None
        median = self.median_s
        if cfg.wait_bound_factor is None or median is None:
            return cfg.wait_bound_s
        return min(max(cfg.wait_bound_factor * median, cfg.wait_bound_min_s), cfg.wait_bound_s)
