"""How much of the ACTING reservations to honour: the adaptive admission law of
docs/admission.md, pure and driven by the scheduler's tick."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thunderctl.scheduler.policy import SchedulerConfig


@dataclass
class AdmissionTuner:
    """Seeks the ACTING weight that gives the most steps per second.

    Two rules, both acting only while requests wait for admission (otherwise the weight
    constrains nothing and is held):

    - *Idle engines*: a tick in which requests waited while the workers were busy less than
      `adapt_utilization_low` of the time lowers the weight at once: reservations held
      capacity that nobody used.
    - *Busy engines*: whether more admission adds throughput or only recompute cannot be seen
      from utilisation, so it is measured. Every `adapt_window_s` the weight moves one
      `adapt_step`: on in the same direction when steps/s rose by more than `adapt_tolerance`
      over the window before, back when they fell by more, and towards full protection when
      they were level. At full protection it stays until steps/s fall.
    """

    config: SchedulerConfig
    weight: float
    direction: int = -1  # -1: towards more admission (less protection)
    _window_start: float | None = None
    _window_steps: int = 0
    _window_waited: bool = False
    _last_rate: float | None = None

    def observe(self, now: float, steps: int, utilization: float, waited: bool) -> float:
        """One tick: `steps` is the running count of responses; returns the new weight."""
        cfg = self.config
        if self._window_start is None:
            self._begin(now, steps)
        if waited and utilization < cfg.adapt_utilization_low:
            self.direction = -1
            self._move()
            self._last_rate = None  # a new level: compare afresh from here
            self._begin(now, steps)
            return self.weight
        self._window_waited |= waited
        elapsed = now - self._window_start  # type: ignore[operator]
        if elapsed < cfg.adapt_window_s:
            return self.weight
        rate = (steps - self._window_steps) / elapsed
        if self._window_waited:
            if self._last_rate is not None:
                self.direction = self._next_direction(rate, self._last_rate)
            self._last_rate = rate
            self._move()
        else:
            self._last_rate = None
        self._begin(now, steps)
        return self.weight

    def _next_direction(self, rate: float, last_rate: float) -> int:
        tolerance = self.config.adapt_tolerance
        if rate > last_rate * (1 + tolerance):
            return self.direction
        if rate < last_rate * (1 - tolerance):
            return -self.direction
        return 1  # level: less admission costs nothing, and protects the cache

    def _move(self) -> None:
        cfg = self.config
        target = self.weight + self.direction * cfg.adapt_step
        self.weight = min(cfg.acting_overbook, max(cfg.acting_weight_min, target))

    def _begin(self, now: float, steps: int) -> None:
        self._window_start, self._window_steps, self._window_waited = now, steps, False
