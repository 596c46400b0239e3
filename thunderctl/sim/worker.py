"""An engine on the virtual clock: it runs steps back to back while it has work, like vLLM's busy loop."""

from __future__ import annotations

from collections.abc import Callable

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
        """The request reaches the engine after the API server's work on it, and its client sees
        the answer after the work on the answer (none without a frontend cost)."""
        answered = request.on_finish
        if answered is not None and self.engine.frontend.per_output_token_s > 0:
            request.on_finish = lambda finished: self._answer(finished, answered)
        at = self.engine.frontend_in_s(request, self.clock.now)
        if at > self.clock.now:
            self.clock.at(at, lambda: self._enter(request))
        else:
            self._enter(request)

    def _enter(self, request: Request) -> None:
        self.engine.submit(request)
        if not self._stepping:
            self._begin()

    def _answer(self, request: Request, answered: Callable[[Request], None]) -> None:
        request.finished_s = self.engine.frontend_out_s(self.clock.now)
        self.clock.at(request.finished_s, lambda: answered(request))

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
