"""How each arm places requests: pinned or least-loaded engines alone, or the project's Scheduler.

The policy router drives `thunderctl.scheduler.Scheduler` through `thunderctl.scheduler.front`,
the piece the gateway drives it with: the same calls, events and tick cadence, on the virtual
clock. Changing the policy changes the simulation; nothing here reimplements it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from thunderctl.scheduler import ProgramEvent, Scheduler, SchedulerConfig
from thunderctl.scheduler.front import WAKING_EVENTS, BusyMeter, account, beat, mean_utilization, woken
from thunderctl.scheduler.placement import home
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.worker import SimWorker

# The key the gateway derives from a program's system message; every simulated program has it.
SYSTEM_PREFIX_KEY = "system"

Go = Callable[[SimWorker], None]


class EngineRouter:
    """Requests go straight to the engines; counts what each worker has in flight."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        self.workers = list(workers)
        self.in_flight = {worker.id: 0 for worker in self.workers}

    def dispatch(self, worker: SimWorker, go: Go) -> None:
        self.in_flight[worker.id] += 1
        go(worker)

    def least_loaded(self) -> SimWorker:
        return min(self.workers, key=lambda w: self.in_flight[w.id])

    def done(
        self, program_id: str, worker: SimWorker, prompt_tokens: int, completion_tokens: int, tool: str | None = None
    ) -> None:
        self.in_flight[worker.id] -= 1

    def release(self, program_id: str) -> None:
        """Engines know nothing of programs."""


class StickyRouter(EngineRouter):
    """Each program pinned to one worker by a hash of its id, as agents and KV-aware routers do."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        super().__init__(workers)
        self.by_id = {worker.id: worker for worker in self.workers}

    def send(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go, group: str | None = None) -> None:
        # The scheduler's own hash home: where nobody waits, affinity placement is this arm.
        self.dispatch(self.by_id[home(program_id, list(self.by_id))], go)


class LeastLoadedRouter(EngineRouter):
    """Each request to the worker with the fewest requests in flight."""

    def send(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go, group: str | None = None) -> None:
        self.dispatch(self.least_loaded(), go)


class PolicyRouter(EngineRouter):
    """The project's scheduler in front of the workers, driven as the gateway drives it."""

    def __init__(
        self, workers: Sequence[SimWorker], clock: VirtualClock, config: SchedulerConfig, host_kv_tokens: int = 0
    ) -> None:
        super().__init__(workers)
        self.clock = clock
        self.by_id = {worker.id: worker for worker in self.workers}
        self.meters = {worker.id: BusyMeter() for worker in self.workers}
        self.scheduler = Scheduler(config, clock, [self._on_program_event])
        for worker in self.workers:
            # A host KV tier is a second level: ACTING programs' KV may spill there (a paused
            # program's comes back by a transfer), what decodes must fit the GPU's cache.
            self.scheduler.add_worker(worker.id, worker.engine.shape.kv_capacity_tokens, host_kv_tokens)
        self._waiting: dict[str, tuple[int, int, Go]] = {}
        clock.after(config.tick_interval_s, self._tick)

    def send(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go, group: str | None = None) -> None:
        worker_id = self.scheduler.on_request(program_id, prompt_tokens, SYSTEM_PREFIX_KEY, shared_tokens, group)
        if worker_id is None:
            self._waiting[program_id] = (prompt_tokens, shared_tokens, go)
            return
        self.dispatch(self.by_id[worker_id], go)

    def dispatch(self, worker: SimWorker, go: Go) -> None:
        self.meters[worker.id].set(self.in_flight[worker.id] + 1, self.clock.now)
        super().dispatch(worker, go)

    def done(
        self, program_id: str, worker: SimWorker, prompt_tokens: int, completion_tokens: int, tool: str | None = None
    ) -> None:
        super().done(program_id, worker, prompt_tokens, completion_tokens)
        self.meters[worker.id].set(self.in_flight[worker.id], self.clock.now)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        account(self.scheduler, program_id, usage, tool)

    def release(self, program_id: str) -> None:
        self.scheduler.release(program_id)

    def _on_program_event(self, event: ProgramEvent) -> None:
        # The gateway's waiting request resumes on the event loop's next turn, not inside the
        # scheduler's call: so does this one.
        if event.kind in WAKING_EVENTS and event.program.id in self._waiting:
            pending = self._waiting.pop(event.program.id)
            self.clock.after(0.0, lambda: self._wake(event.program.id, *pending))

    def _wake(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go) -> None:
        placement = woken(self.scheduler, program_id)
        if placement is None:
            self.send(program_id, prompt_tokens, shared_tokens, go)
        elif placement.worker is None:
            self.dispatch(self.least_loaded(), go)
        else:
            self.dispatch(self.by_id[placement.worker], go)

    def _tick(self) -> None:
        beat(self.scheduler, mean_utilization(self.meters.values(), self.clock.now))
        self.clock.after(self.scheduler.config.tick_interval_s, self._tick)
