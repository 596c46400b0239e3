"""A vLLM worker as the gateway sees it: its load, its last metrics, and the state it is in."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from thunderctl.engines.vllm import EngineMetrics
from thunderctl.scheduler.front import BusyMeter


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DRAINED = "drained"
    UNHEALTHY = "unhealthy"
    STALLED = "stalled"
    PAUSED = "paused"  # its engine says so (a weight update): nothing is lost, it resumes
    STOPPED = "stopped"


@dataclass
class WorkerLink:
    """One vLLM worker as the gateway sees it."""

    id: str
    url: str
    in_flight: int = 0
    meter: BusyMeter = field(default_factory=BusyMeter)
    metrics: EngineMetrics | None = None
    draining: bool = False
    healthy: bool = True
    stopped: bool = False
    failures: int = 0  # consecutive failed polls
    stalled: bool = False
    last_progress_s: float = 0.0  # when a request last ended, or started on an idle worker
    host_kv_tokens: int = 0  # its host KV tier (vLLM's CPU offloading), from the profile
    engine_paused: bool = False  # its engine's GET /is_paused at the last poll

    @property
    def capacity(self) -> int | None:
        return self.metrics.kv_capacity_tokens if self.metrics else None

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining and not self.stopped and not self.stalled

    def add_in_flight(self, delta: int, now: float) -> None:
        self.in_flight += delta
        self.meter.set(self.in_flight, now)
        if delta < 0 or self.in_flight == delta:
            self.last_progress_s = now

    def state(self, holds_programs: bool) -> WorkerState:
        """`holds_programs`: the scheduler still places programs on it (a draining worker is
        drained once it holds none and serves no request)."""
        if self.stopped:
            return WorkerState.STOPPED
        if not self.healthy:  # no metrics since it was started (again): still loading
            return WorkerState.UNHEALTHY if self.metrics else WorkerState.STARTING
        if self.stalled:
            return WorkerState.STALLED
        if self.draining:
            return WorkerState.DRAINED if self.in_flight == 0 and not holds_programs else WorkerState.DRAINING
        if self.engine_paused:
            return WorkerState.PAUSED
        return WorkerState.READY if self.metrics else WorkerState.STARTING
