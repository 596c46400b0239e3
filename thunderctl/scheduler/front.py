"""How a front end drives the scheduler, in one piece the gateway and the simulator share.

The gateway (real time, HTTP) and the simulator (virtual time) call the policy the same way:
a request asks `on_request` and, when told to wait, waits for a waking event and asks `woken`;
a response's usage goes to `account`; every tick interval, `beat` feeds the workers' busy
fraction (from their `BusyMeter`s) to the admission law and ticks the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from thunderctl.scheduler.events import EventKind
from thunderctl.scheduler.policy import Scheduler
from thunderctl.scheduler.program import Status

# Events after which a waiting request asks again where it goes.
WAKING_EVENTS = frozenset({EventKind.RESUMED, EventKind.RELEASED, EventKind.EXPIRED})


@dataclass
class BusyMeter:
    """The fraction of time a worker had at least one request in flight."""

    _busy: bool = False
    _since: float = 0.0
    _integral: float = 0.0
    _period_start: float | None = None

    def set(self, in_flight: int, now: float) -> None:
        self._accumulate(now)
        self._busy = in_flight > 0

    def take(self, now: float) -> float:
        """Utilisation since the last take (0-1); starts a new period."""
        self._accumulate(now)
        start = self._period_start if self._period_start is not None else now
        value = self._integral / (now - start) if now > start else float(self._busy)
        self._integral, self._period_start = 0.0, now
        return value

    def _accumulate(self, now: float) -> None:
        if self._period_start is None:
            self._period_start = now
        else:
            self._integral += self._busy * (now - self._since)
        self._since = now


def mean_utilization(meters: Iterable[BusyMeter], now: float) -> float:
    """Mean utilisation of the given workers (those in service) since the last call."""
    values = [meter.take(now) for meter in meters]
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class Placement:
    """Where a woken request goes: its worker, or None to be served unscheduled."""

    worker: str | None


def woken(scheduler: Scheduler, program_id: str) -> Placement | None:
    """After a waking event: where the waiting request goes, or None to ask `on_request` again."""
    program = scheduler.programs.get(program_id)
    if program is None:  # released while it waited: serve it unscheduled
        return Placement(None)
    if program.status is Status.ACTIVE:
        return Placement(program.worker)
    return None


def account(
    scheduler: Scheduler, program_id: str | None, usage: dict[str, Any] | None, tool: str | None = None
) -> None:
    """A request of the program ended: with usage it ACTs (in `tool`, when the answer names
    one) at its new size, without it failed."""
    if program_id is None:
        return
    if usage:
        scheduler.on_response(program_id, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), tool)
    else:
        scheduler.on_request_failed(program_id)


def beat(scheduler: Scheduler, utilization: float) -> None:
    """One beat of the tick loop: the admission law sees the last period, then the policy ticks."""
    scheduler.adapt(utilization)
    try:
        scheduler.tick()
    except Exception:
        pass  # logged by the scheduler, which has already let every paused program go
