"""Stalled workers: requests in flight and no progress for a bound, and giving up their unanswered requests.

A stall is what a health check cannot see: a worker whose HTTP server answers `/health` and
`/metrics` while its engine never finishes a request (a hung GPU, a deadlocked engine core).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from types import TracebackType


class WorkerStalled(RuntimeError):
    """A request given up on a stalled worker before its answer's first byte; it is sent elsewhere."""


@dataclass
class StallWatch:
    """Pure: from what the gateway sees of each worker, whether it has stalled.

    Progress is a request ending or starting on an idle worker (the gateway stamps it, as
    `last_progress_s`), or the worker's generated-token counter moving between two polls (so a
    worker busy with long answers is not taken for stalled). A worker with requests in flight
    and no progress for `bound_s` has stalled. It serves again once its counter moves, or once it
    reports no request running or waiting (what it was stuck on is gone). An engine that says it
    is paused (a weight update) is not stalled: its clock starts again when it resumes.
    """

    bound_s: float
    _tokens: dict[str, int] = field(default_factory=dict)
    _counter_moved_s: dict[str, float] = field(default_factory=dict)
    stalled: set[str] = field(default_factory=set)

    def polled(
        self,
        worker_id: str,
        *,
        in_flight: int,
        last_progress_s: float,
        generation_tokens: int,
        engine_busy: bool,
        now_s: float,
        engine_paused: bool = False,
    ) -> bool:
        """One poll of the worker's metrics; returns whether it is stalled now."""
        moved = self._tokens.get(worker_id) != generation_tokens or engine_paused
        self._tokens[worker_id] = generation_tokens
        if moved:
            self._counter_moved_s[worker_id] = now_s
        if worker_id in self.stalled:
            if moved or not engine_busy:
                self.stalled.discard(worker_id)
                self._counter_moved_s[worker_id] = now_s  # its clock starts again as it rejoins
            return worker_id in self.stalled
        progress_s = max(last_progress_s, self._counter_moved_s[worker_id])
        if in_flight > 0 and now_s - progress_s >= self.bound_s:
            self.stalled.add(worker_id)
        return worker_id in self.stalled


class Unanswered:
    """One request's wait for its worker's answer (`async with`), which `Unanswered.give_up` ends."""

    def __init__(self, waiting: set[Unanswered]) -> None:
        self._waiting = waiting
        self._cutoff = asyncio.timeout(None)

    async def __aenter__(self) -> None:
        await self._cutoff.__aenter__()
        self._waiting.add(self)

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._waiting.discard(self)
        try:
            await self._cutoff.__aexit__(kind, exc, traceback)
        except TimeoutError as timeout:
            if self._cutoff.expired():  # given up, not a TimeoutError of the request's own
                raise WorkerStalled("its worker stalled") from timeout
            raise

    def give_up(self) -> None:
        self._waiting.discard(self)
        # asyncio.timeout cancels the waiting task at its await and turns that into TimeoutError.
        self._cutoff.reschedule(asyncio.get_running_loop().time())


@dataclass
class UnansweredRequests:
    """Each worker's requests that have had no byte of their answer yet."""

    _by_worker: defaultdict[str, set[Unanswered]] = field(default_factory=lambda: defaultdict(set))

    def waiting_on(self, worker_id: str) -> Unanswered:
        return Unanswered(self._by_worker[worker_id])

    def give_up(self, worker_id: str) -> int:
        """Ends the waits of the worker's unanswered requests (each raises WorkerStalled); how many."""
        waiting = list(self._by_worker[worker_id])
        for request in waiting:
            request.give_up()
        return len(waiting)
