"""The wait bound: how long a waiting request may wait before ACTING programs pause for it.

By default a fixed `wait_bound_s` (400 s). With `wait_bound_factor` set the bound follows what
waiting programs see instead: that many times the median of the recent admission waits (of
requests that waited at all), between a floor and `wait_bound_s`. docs/admission.md, "The
bound follows the waits", has the law, why it is stable, and why it is not the default."""

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

    def snapshot(self) -> list[float]:
        return list(self._waits)

    def restore(self, waits: list[float]) -> None:
        self._waits.clear()
        self._waits.extend(waits)

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
