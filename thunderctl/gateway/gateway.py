"""The gateway's scheduler side: admits each program's requests through the scheduler, hears how
their answers end, and watches the workers.

One asyncio process: request handlers, a scheduler tick loop and an engine-metrics poller. The
scheduler stays synchronous; this module is the only place it meets I/O. The bytes of each request
and answer go through the relay (relay.py), which asks and tells this side only through the
messages of admissions.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from thunderctl.engines.vllm import EngineMetrics, engine_paused, fetch_metrics, is_healthy
from thunderctl.gateway.admissions import Admission, Admitted, AnswerEnd, Chain, Failure, Relays
from thunderctl.gateway.answers import uncached_prompt_tokens
from thunderctl.gateway.chains import ResponseChains
from thunderctl.gateway.derived import DerivedPrograms
from thunderctl.gateway.identity import Candidates, Claim, IdentityConfig, Keys, PromptKeys, PromptMatches
from thunderctl.gateway.links import WorkerLink, WorkerState
from thunderctl.gateway.recorder import TraceRecorder
from thunderctl.gateway.relay import Relay
from thunderctl.gateway.requests import PromptShape, TokenEstimator
from thunderctl.gateway.restored import Restored
from thunderctl.gateway.stalls import StallWatch
from thunderctl.gateway.timings import GatewayTimings, watch_loop_lag
from thunderctl.gateway.transport import AiohttpTransport, worker_client
from thunderctl.scheduler import EventKind, ProgramEvent, Scheduler, SchedulerConfig
from thunderctl.scheduler.front import (
    WAKING_EVENTS,
    account,
    beat,
    mean_utilization,
    woken,
)

log = logging.getLogger(__name__)


class WorkerUnreachable(RuntimeError):
    pass


# Consecutive failed health/metrics polls before a worker is taken out of scheduling.
UNHEALTHY_AFTER = 3
# How long a connect to a worker may take. Its timing out is no verdict on the worker (see _fail_over).
WORKER_CONNECT_TIMEOUT_S = 10.0
# vLLM's API server (uvicorn) closes a connection idle for 5 s. A pooled connection is dropped
# before that, or a request sent on it as the worker closes it fails (ReadError) and the worker
# looks dead.
WORKER_KEEPALIVE_S = 4.0
# Agents' connections idle through their tool calls; the gateway keeps them open longer than
# their clients' pools (httpx: 5 s), so that the client, not the gateway, closes an idle one.
AGENT_KEEPALIVE_S = 65


class Gateway:
    def __init__(
        self,
        links: list[WorkerLink],
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_interval_s: float = 2.0,
        recorder: TraceRecorder | None = None,
        worker_key: str | None = None,
        resumed_priority: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # the workers' HTTP; tests pass a fake
        connect_timeout_s: float = WORKER_CONNECT_TIMEOUT_S,
        identity: IdentityConfig | None = None,
    ) -> None:
        if not links:
            raise ValueError("the gateway needs at least one backend")
        self.links = {u.id: u for u in links}
        self.scheduler = Scheduler(config, clock, [self._on_program_event])
        self.last_utilization = 0.0
        self.estimator = TokenEstimator()
        self.recorder = recorder
        # Programs of requests that name none, found from their conversation.
        self.derived = DerivedPrograms(identity or IdentityConfig())
        # Responses kept for `previous_response_id` chains across workers.
        self.chains = ResponseChains()
        self.timings = GatewayTimings()
        self.metrics_interval_s = metrics_interval_s
        self.started_at = clock()
        self._clock = clock
        self._resumed: dict[str, asyncio.Event] = {}
        self.stalls = StallWatch(self.scheduler.config.stall_timeout_s)
        # Cleared while the cluster is paused for a weight update (admin.py): requests wait here.
        self.admitting = asyncio.Event()
        self.admitting.set()
        self._tasks: list[asyncio.Task[None]] = []
        self.client_disconnects = 0  # clients gone before their request's body had arrived
        # Awaited once an answer's derived conversation or chain is remembered, with the answer's
        # program, before the answer's end reaches its client: the daemon's journal writes them
        # there, so that a client that has its answer whole can count on a restarted daemon knowing
        # it. None: nothing is kept.
        self.keep_answers: Callable[[str | None], Awaitable[None]] | None = None
        # Every call to a worker (relay, health, metrics) carries the cluster's worker key.
        self._transport = transport or AiohttpTransport(WORKER_KEEPALIVE_S)
        self._client = worker_client(self._transport, worker_key, connect_timeout_s)
        # This process's relay; it and the gateway tell each other only what admissions.py declares.
        self.relay = Relay(self, self._client, self._transport, clock, resumed_priority)
        self.relays: list[Relays] = [self.relay]

    # ---- life -----------------------------------------------------------------------------

    async def start(self, restored: Restored | None = None) -> list[str]:
        """Check every worker, read its KV capacity, take back what a gateway before this one left
        (`restored`), start the loops. Returns warnings.

        A first start needs every worker to answer. One that takes over from another serves with the
        workers that answer: the others' programs pause, as a drain pauses them, and resume elsewhere.
        """
        warnings = []
        for link in self.links.values():
            if not await is_healthy(self._client, link.url):
                if restored is None:
                    raise WorkerUnreachable(
                        f"backend {link.id} at {link.url} does not answer GET /health; "
                        "is vLLM running there and the address right?"
                    )
                warnings.append(f"worker {link.id} ({link.url}) does not answer; its programs pause")
                link.healthy = False
            else:
                link.metrics = await fetch_metrics(self._client, link.url)
                if link.capacity is None:
                    warnings.append(
                        f"backend {link.id} ({link.url}) reports no vllm:cache_config_info: "
                        "its programs are served unscheduled (never paused)"
                    )
            self.scheduler.add_worker(link.id, link.capacity, link.host_kv_tokens)
        if restored is not None:
            self._restore(restored)
        self._tasks = [
            asyncio.create_task(self._tick_loop(), name="scheduler-tick"),
            asyncio.create_task(self._metrics_loop(), name="metrics-poll"),
            asyncio.create_task(watch_loop_lag(self.timings.loop_lag.observe), name="loop-lag"),
        ]
        return warnings

    def _restore(self, restored: Restored) -> None:
        self.scheduler.restore(restored.scheduler, restored.elapsed_s)
        self.derived.restore(restored.derived, restored.conversations)
        self.chains.restore(restored.responses)
        for link in self.links.values():
            if not link.usable:
                self.scheduler.drain(link.id)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._client.aclose()
        if self.recorder is not None:
            self.recorder.close()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.scheduler.config.tick_interval_s)
            with self.timings.tick.time():
                beat(self.scheduler, self.utilization())

    @property
    def http(self) -> httpx.AsyncClient:
        """The client every call to a worker goes through (it carries the worker key)."""
        return self._client

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def utilization(self) -> float:
        """Mean utilisation of the workers in service since the last call."""
        meters = [u.meter for u in self.links.values() if u.usable]
        self.last_utilization = mean_utilization(meters, self._clock())
        return self.last_utilization

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            await self.refresh_metrics()

    async def refresh_metrics(self) -> None:
        results = await asyncio.gather(
            *(fetch_metrics(self._client, u.url) for u in self.links.values()),
            return_exceptions=True,
        )
        paused = await asyncio.gather(*(engine_paused(self._client, u.url) for u in self.links.values()))
        for link, result, link_paused in zip(self.links.values(), results, paused, strict=True):
            if link.stopped:
                continue
            link.engine_paused = link_paused
            if isinstance(result, BaseException):
                link.failures += 1
                log.warning("metrics of %s unavailable (%d in a row): %s", link.id, link.failures, result)
                if link.failures >= UNHEALTHY_AFTER:
                    self.mark_unhealthy(link)
                continue
            link.failures = 0
            link.metrics = result
            self.scheduler.add_worker(link.id, link.capacity, link.host_kv_tokens)
            if not link.healthy:
                log.warning("worker %s answers again", link.id)
                link.healthy = True
                self.scheduler.set_schedulable(link.id, link.usable)
            self.watch_stall(link, result)

    # ---- worker states --------------------------------------------------------------------

    def mark_unhealthy(self, link: WorkerLink) -> None:
        """Its programs go back to the global queue and resume on other workers."""
        if link.healthy:
            log.warning("worker %s is unhealthy; its programs move to other workers", link.id)
        link.healthy = False
        self.scheduler.drain(link.id)

    def watch_stall(self, link: WorkerLink, metrics: EngineMetrics) -> None:
        """A stalled worker is taken out of scheduling and its unanswered requests go to other
        workers (stalls.py says when); it rejoins once it makes progress again."""
        stalled = self.stalls.polled(
            link.id,
            in_flight=link.in_flight,
            last_progress_s=link.last_progress_s,
            generation_tokens=metrics.generation_tokens,
            engine_busy=metrics.requests_running + metrics.requests_waiting > 0,
            now_s=self._clock(),
            engine_paused=link.engine_paused,
        )
        if stalled == link.stalled:
            return
        link.stalled = stalled
        if stalled:
            given_up = sum(relay.give_up(link.id) for relay in self.relays)
            log.warning(
                "worker %s stalled (%d request(s) in flight, no progress for %gs); its programs and %d unanswered "
                "request(s) move to other workers",
                link.id, link.in_flight, self.stalls.bound_s, given_up,
            )  # fmt: skip
            self.scheduler.drain(link.id)
        else:
            log.warning("worker %s makes progress again; it rejoins scheduling", link.id)
            self.scheduler.set_schedulable(link.id, link.usable)

    def drain(self, worker_id: str) -> None:
        link = self.links[worker_id]
        link.draining = True
        self.scheduler.drain(worker_id)

    def undrain(self, worker_id: str) -> None:
        link = self.links[worker_id]
        link.draining = False
        self.scheduler.set_schedulable(worker_id, link.usable)

    def restarting(self, worker_id: str) -> None:
        """Its process was started again: out of scheduling, and `starting`, until its metrics answer."""
        link = self.links[worker_id]
        link.metrics = None
        self.mark_unhealthy(link)

    def mark_stopped(self, worker_id: str) -> None:
        link = self.links[worker_id]
        link.stopped = True
        self.scheduler.drain(worker_id)

    def worker_state(self, link: WorkerLink) -> WorkerState:
        # Only a draining worker's programs matter (DRAINING or DRAINED).
        return link.state(holds_programs=link.draining and bool(self.scheduler.workers[link.id].programs))

    # ---- admission ------------------------------------------------------------------------

    def _on_program_event(self, event: ProgramEvent) -> None:
        self.derived.on_program_event(event)
        if event.kind in (EventKind.RELEASED, EventKind.EXPIRED):
            self.chains.forget_program(event.program.id)
            if self.recorder is not None:
                self.recorder.on_end(event.program.id)
        if event.kind in WAKING_EVENTS:
            waiter = self._resumed.pop(event.program.id, None)
            if waiter is not None:
                waiter.set()

    async def _admit_program(
        self, program_id: str, shape: PromptShape, group: str | None, parent: str | None
    ) -> tuple[WorkerLink, bool]:
        while True:
            worker = self.scheduler.on_request(
                program_id,
                self.estimator.prompt_tokens(shape),
                shape.prefix_key,
                self.estimator.estimate(shape.prefix_chars),
                group,
                parent,
            )
            if worker is not None:
                return self.links[worker], False
            waiter = self._resumed.setdefault(program_id, asyncio.Event())
            await waiter.wait()
            placement = woken(self.scheduler, program_id)
            if placement is not None:
                return (self.links[placement.worker] if placement.worker else self.least_loaded()), True

    def least_loaded(self, avoid: WorkerLink | None = None) -> WorkerLink:
        usable = [u for u in self.links.values() if u.usable]
        candidates = [u for u in usable if u is not avoid] or usable or list(self.links.values())
        return min(candidates, key=lambda u: u.in_flight)

    # ---- the relay's messages (admissions.py) ----------------------------------------------

    @property
    def keeps_answers(self) -> bool:
        return self.keep_answers is not None

    async def admit(self, admission: Admission) -> Admitted:
        """An unscheduled request goes elsewhere than `avoid` (the worker that just failed it) while
        another worker is usable; a program's requeue did the same."""
        program_id = admission.program_id
        if self.recorder is not None and program_id is not None and admission.attempt == 1:
            self.recorder.on_request(program_id)
        await self.admitting.wait()
        if program_id is None:
            avoid = self.links[admission.avoid] if admission.avoid is not None else None
            link, waited = self.least_loaded(avoid), False
        else:
            with self.timings.admission_wait.time():
                link, waited = await self._admit_program(program_id, admission.shape, admission.group, admission.parent)
        link.add_in_flight(1, self._clock())
        return Admitted(link.id, link.url, waited)

    @property
    def remote(self) -> bool:
        return False

    @property
    def derives(self) -> bool:
        return self.derived.on

    async def claim(self, keys: Keys, matches: PromptMatches) -> Claim | None:
        return self.derived.claim(keys, matches)

    async def candidates(self, keys: PromptKeys) -> Candidates:
        return self.derived.candidates(keys)

    async def chain(self, response_id: str) -> Chain | None:
        kept = self.chains.get(response_id)
        return Chain(kept.program_id, self.chains.items(response_id)) if kept is not None else None

    def finished(self, end: AnswerEnd) -> None:
        usage = end.usage
        self.links[end.worker].add_in_flight(-1, self._clock())
        if usage and usage.get("prompt_tokens"):
            self.estimator.observe(end.shape, usage["prompt_tokens"])
        if end.program_id is not None and usage and self.recorder is not None:
            self.recorder.on_usage(end.program_id, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        if usage and end.ttft_s:
            self.scheduler.observe_prefill(uncached_prompt_tokens(usage), end.ttft_s)
        account(self.scheduler, end.program_id, usage, end.tool)
        if end.conversation is not None and end.program_id is not None:
            self.derived.remember(end.program_id, end.conversation)
        if end.chain is not None and end.response is not None:
            self.chains.keep(end.chain.program_id, end.chain.previous, end.chain.own_input, end.response)

    async def failed(self, failure: Failure) -> bool:
        link = self.links[failure.worker]
        link.add_in_flight(-1, self._clock())
        if failure.attempt == 1 and self._fail_over(link, failure.program_id, failure.worker_down):
            return True
        if failure.program_id is not None:
            self.scheduler.on_request_failed(failure.program_id)
        return False

    async def ended(self, end: AnswerEnd, keep: bool) -> None:
        self.finished(end)
        await self.kept(end.program_id, keep)

    async def kept(self, program_id: str | None, keep: bool) -> None:
        """Until what the program's last answer taught is kept, when `keep` and the journal keeps it."""
        if keep and self.keep_answers is not None:
            await self.keep_answers(program_id)

    async def route(self, program_id: str | None) -> Admitted:
        program = self.scheduler.programs.get(program_id) if program_id else None
        worker = program.worker if program is not None and program.worker in self.links else None
        link = self.links[worker] if worker is not None and self.links[worker].usable else self.least_loaded()
        return Admitted(link.id, link.url)

    def _fail_over(self, link: WorkerLink, program_id: str | None, worker_down: bool) -> bool:
        """Take a worker that refused a connection out of scheduling (a stalled one is out already);
        the request goes back to the queue, to go again elsewhere. Is there a worker to try it on?"""
        # A connect timeout is no verdict (not `worker_down`): on a starved event loop the timer
        # fires before the loop sees the connection the worker made at once. The worker stays in
        # service and the health poll decides whether it is dead; the request goes to another worker
        # if one is usable (a worker whose accept queue is full drops connects until it catches up),
        # else to the same.
        if worker_down:
            self.mark_unhealthy(link)
        if program_id is not None:
            self.scheduler.requeue(program_id, avoid=link.id)
        return any(u.usable for u in self.links.values())

    def count_client_disconnect(self) -> int:
        self.client_disconnects += 1
        return self.client_disconnects
