"""An engine on the virtual clock: it runs steps back to back while it has work, like vLLM's busy loop."""

from __future__ import annotations

from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.engine import Engine, Request


class SimWorker:
    """One DP replica. A request submitted mid-step is scheduled at the next step boundary."""

    def __init__(self, worker_id: str, engine: Engine, clock: VirtualClock) -> None:
        self.id = worker_id
        self.engine = engine
        self.clock = clock
        self._stepping = False
        self._wake_at: float | None = None

    def submit(self, request: Request) -> None:
        self.engine.submit(request)
        if not self._stepping:
            self._begin()

    def _begin(self) -> None:
        seconds = self.engine.begin_step(self.clock.now)
        if seconds is None:
            self._stepping = False
            wake = self.engine.wake_s()
            if wake is not None and wake != self._wake_at:
                self._wake_at = wake
                self.clock.at(wake, self._wake)
            return
        self._stepping = True
        self.clock.after(seconds, self._end)

    def _end(self) -> None:
        self.engine.end_step(self.clock.now)  # finished requests' callbacks may submit here
        self._begin()

    def _wake(self) -> None:
        self._wake_at = None
        if not self._stepping:
            self._begin()
