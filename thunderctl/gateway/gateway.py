"""The gateway: admits each program's requests through the scheduler and relays them to vLLM.

One asyncio process: request handlers, a scheduler tick loop and an engine-metrics poller.
The scheduler stays synchronous; this module is the only place it meets I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from thunderctl.engines.vllm import EngineMetrics, fetch_metrics, is_healthy
from thunderctl.gateway.answers import (
    StreamedAnswer,
    tool_in_response,
    uncached_prompt_tokens,
)
from thunderctl.gateway.recorder import TraceRecorder
from thunderctl.gateway.requests import PromptShape, TokenEstimator
from thunderctl.gateway.sse import StreamRelay
from thunderctl.gateway.stalls import StallWatch, UnansweredRequests, WorkerStalled
from thunderctl.gateway.timings import GatewayTimings, watch_loop_lag
from thunderctl.gateway.transport import AiohttpTransport
from thunderctl.jsonapi import bearer_headers
from thunderctl.scheduler import EventKind, ProgramEvent, Scheduler, SchedulerConfig
from thunderctl.scheduler.front import (
    WAKING_EVENTS,
    BusyMeter,
    account,
    beat,
    mean_utilization,
    woken,
)

log = logging.getLogger(__name__)


class BackendUnreachable(RuntimeError):
    pass


class BackendError(RuntimeError):
    """A backend could not be reached mid-request; the client gets a 502 naming it."""


# Consecutive failed health/metrics polls before a worker is taken out of scheduling.
UNHEALTHY_AFTER = 3
# vLLM's API server (uvicorn) closes a connection idle for 5 s. A pooled connection is dropped
# before that, or a request sent on it as the worker closes it fails (ReadError) and the worker
# looks dead.
WORKER_KEEPALIVE_S = 4.0
# Agents' connections idle through their tool calls; the gateway keeps them open longer than
# their clients' pools (httpx: 5 s), so that the client, not the gateway, closes an idle one.
AGENT_KEEPALIVE_S = 65


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DRAINED = "drained"
    UNHEALTHY = "unhealthy"
    STALLED = "stalled"
    STOPPED = "stopped"


@dataclass
class Upstream:
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


@dataclass(frozen=True)
class Relayed:
    """A backend's answer: a whole body, or a stream of SSE events as they come."""

    status: int
    media_type: str
    body: bytes | AsyncGenerator[bytes, None]


def reads(response: httpx.Response) -> AsyncIterator[bytes]:
    """A streamed answer's body, read by read. An SSE stream is not content-encoded (vLLM's is
    not), so its reads come straight from the transport, past httpx's two layers of decoding and
    re-chunking that would pass them on unchanged, at a cost per read."""
    if "content-encoding" in response.headers or not isinstance(response.stream, httpx.AsyncByteStream):
        return response.aiter_bytes()
    return aiter(response.stream)


class Gateway:
    def __init__(
        self,
        upstreams: list[Upstream],
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_interval_s: float = 2.0,
        recorder: TraceRecorder | None = None,
        worker_key: str | None = None,
        resumed_priority: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # the workers' HTTP; tests pass a fake
    ) -> None:
        if not upstreams:
            raise ValueError("the gateway needs at least one backend")
        self.upstreams = {u.id: u for u in upstreams}
        self.scheduler = Scheduler(config, clock, [self._on_program_event])
        self.last_utilization = 0.0
        self.estimator = TokenEstimator()
        self.recorder = recorder
        self.timings = GatewayTimings()
        self.resumed_priority = resumed_priority  # sent with a request that waited for its resume
        self.metrics_interval_s = metrics_interval_s
        self.started_at = clock()
        self._clock = clock
        self._resumed: dict[str, asyncio.Event] = {}
        self.stalls = StallWatch(self.scheduler.config.stall_timeout_s)
        self.unanswered = UnansweredRequests()
        self._tasks: list[asyncio.Task[None]] = []
        # Every call to a worker (relay, health, metrics) carries the cluster's worker key.
        self._client = httpx.AsyncClient(
            headers=bearer_headers(worker_key),
            timeout=httpx.Timeout(None, connect=10.0),
            transport=transport or AiohttpTransport(keepalive_s=WORKER_KEEPALIVE_S),
        )

    # ---- life -----------------------------------------------------------------------------

    async def start(self) -> list[str]:
        """Check every backend, read its KV capacity, start the loops. Returns warnings."""
        warnings = []
        for upstream in self.upstreams.values():
            if not await is_healthy(self._client, upstream.url):
                raise BackendUnreachable(
                    f"backend {upstream.id} at {upstream.url} does not answer GET /health; "
                    "is vLLM running there and the address right?"
                )
            upstream.metrics = await fetch_metrics(self._client, upstream.url)
            if upstream.capacity is None:
                warnings.append(
                    f"backend {upstream.id} ({upstream.url}) reports no vllm:cache_config_info: "
                    "its programs are served unscheduled (never paused)"
                )
            self.scheduler.add_backend(upstream.id, upstream.capacity, upstream.host_kv_tokens)
        self._tasks = [
            asyncio.create_task(self._tick_loop(), name="scheduler-tick"),
            asyncio.create_task(self._metrics_loop(), name="metrics-poll"),
            asyncio.create_task(watch_loop_lag(self.timings.loop_lag.observe), name="loop-lag"),
        ]
        return warnings

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

    def utilization(self) -> float:
        """Mean utilisation of the workers in service since the last call."""
        meters = [u.meter for u in self.upstreams.values() if u.usable]
        self.last_utilization = mean_utilization(meters, self._clock())
        return self.last_utilization

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            await self.refresh_metrics()

    async def refresh_metrics(self) -> None:
        results = await asyncio.gather(
            *(fetch_metrics(self._client, u.url) for u in self.upstreams.values()),
            return_exceptions=True,
        )
        for upstream, result in zip(self.upstreams.values(), results, strict=True):
            if upstream.stopped:
                continue
            if isinstance(result, BaseException):
                upstream.failures += 1
                log.warning("metrics of %s unavailable (%d in a row): %s", upstream.id, upstream.failures, result)
                if upstream.failures >= UNHEALTHY_AFTER:
                    self.mark_unhealthy(upstream)
                continue
            upstream.failures = 0
            upstream.metrics = result
            self.scheduler.add_backend(upstream.id, upstream.capacity, upstream.host_kv_tokens)
            if not upstream.healthy:
                log.warning("worker %s answers again", upstream.id)
                upstream.healthy = True
                self.scheduler.set_schedulable(upstream.id, upstream.usable)
            self.watch_stall(upstream, result)

    # ---- worker states --------------------------------------------------------------------

    def mark_unhealthy(self, upstream: Upstream) -> None:
        """Its programs go back to the global queue and resume on other workers."""
        if upstream.healthy:
            log.warning("worker %s is unhealthy; its programs move to other workers", upstream.id)
        upstream.healthy = False
        self.scheduler.drain(upstream.id)

    def watch_stall(self, upstream: Upstream, metrics: EngineMetrics) -> None:
        """A stalled worker is taken out of scheduling and its unanswered requests go to other
        workers (stalls.py says when); it rejoins once it makes progress again."""
        stalled = self.stalls.polled(
            upstream.id,
            in_flight=upstream.in_flight,
            last_progress_s=upstream.last_progress_s,
            generation_tokens=metrics.generation_tokens,
            engine_busy=metrics.requests_running + metrics.requests_waiting > 0,
            now_s=self._clock(),
        )
        if stalled == upstream.stalled:
            return
        upstream.stalled = stalled
        if stalled:
            given_up = self.unanswered.give_up(upstream.id)
            log.warning(
                "worker %s stalled (%d request(s) in flight, no progress for %gs); its programs and %d unanswered "
                "request(s) move to other workers",
                upstream.id, upstream.in_flight, self.stalls.bound_s, given_up,
            )  # fmt: skip
            self.scheduler.drain(upstream.id)
        else:
            log.warning("worker %s makes progress again; it rejoins scheduling", upstream.id)
            self.scheduler.set_schedulable(upstream.id, upstream.usable)

    def drain(self, worker_id: str) -> None:
        upstream = self.upstreams[worker_id]
        upstream.draining = True
        self.scheduler.drain(worker_id)

    def undrain(self, worker_id: str) -> None:
        upstream = self.upstreams[worker_id]
        upstream.draining = False
        self.scheduler.set_schedulable(worker_id, upstream.usable)

    def mark_stopped(self, worker_id: str) -> None:
        upstream = self.upstreams[worker_id]
        upstream.stopped = True
        self.scheduler.drain(worker_id)

    def worker_state(self, upstream: Upstream) -> WorkerState:
        if upstream.stopped:
            return WorkerState.STOPPED
        if not upstream.healthy:
            return WorkerState.UNHEALTHY
        if upstream.stalled:
            return WorkerState.STALLED
        if upstream.draining:
            idle = upstream.in_flight == 0 and not self.scheduler.backends[upstream.id].programs
            return WorkerState.DRAINED if idle else WorkerState.DRAINING
        return WorkerState.READY if upstream.metrics else WorkerState.STARTING

    # ---- admission ------------------------------------------------------------------------

    def _on_program_event(self, event: ProgramEvent) -> None:
        if self.recorder is not None and event.kind in (EventKind.RELEASED, EventKind.EXPIRED):
            self.recorder.on_end(event.program.id)
        if event.kind in WAKING_EVENTS:
            waiter = self._resumed.pop(event.program.id, None)
            if waiter is not None:
                waiter.set()

    async def admit(self, program_id: str | None, shape: PromptShape) -> tuple[Upstream, bool]:
        """Where this request goes, and whether it waited here for its program's resume."""
        if program_id is None:
            return self.least_loaded(), False
        with self.timings.admission_wait.time():
            return await self._admit_program(program_id, shape)

    async def _admit_program(self, program_id: str, shape: PromptShape) -> tuple[Upstream, bool]:
        while True:
            backend = self.scheduler.on_request(
                program_id,
                self.estimator.prompt_tokens(shape),
                shape.prefix_key,
                self.estimator.estimate(shape.prefix_chars),
            )
            if backend is not None:
                return self.upstreams[backend], False
            waiter = self._resumed.setdefault(program_id, asyncio.Event())
            await waiter.wait()
            placement = woken(self.scheduler, program_id)
            if placement is not None:
                return (self.upstreams[placement.backend] if placement.backend else self.least_loaded()), True

    def least_loaded(self) -> Upstream:
        candidates = [u for u in self.upstreams.values() if u.usable] or list(self.upstreams.values())
        return min(candidates, key=lambda u: u.in_flight)

    # ---- relaying -------------------------------------------------------------------------

    async def relay(self, path: str, body: dict[str, Any], program_id: str | None, shape: PromptShape) -> Relayed:
        """Send the request to its backend; account the engine's usage when it ends.

        A request that fails before any byte reached the client (its worker died or stalled) is tried
        once more on another worker.
        """
        stream = bool(body.get("stream"))
        client_wants_usage = True
        if stream:
            options = body.get("stream_options") or {}
            client_wants_usage = bool(options.get("include_usage"))
            body["stream_options"] = {**options, "include_usage": True}
        if self.recorder is not None and program_id is not None:
            self.recorder.on_request(program_id)
        # ASCII escapes: a lone surrogate from the client's JSON stays representable.
        payload = json.dumps(body).encode()
        for attempt in (1, 2):
            upstream, waited = await self.admit(program_id, shape)
            if waited and self.resumed_priority is not None:
                # Resumed programs first inside the engine, as Dynamo's resume boost does.
                payload = json.dumps({**body, "priority": self.resumed_priority}).encode()
            upstream.add_in_flight(1, self._clock())
            answer = StreamedAnswer(sent_at=self._clock())
            response = None
            try:
                async with self.unanswered.waiting_on(upstream.id):  # given up if the worker stalls
                    response = await self._client.send(
                        self._client.build_request(
                            "POST",
                            f"{upstream.url}{path}",
                            content=payload,
                            headers={"content-type": "application/json"},
                        ),
                        stream=True,
                    )
                    if response.status_code == 200 and stream:
                        lines = self._relay_stream(response, upstream, program_id, shape, client_wants_usage, answer)
                        return Relayed(200, response.headers.get("content-type", "text/event-stream"), lines)
                    content = await response.aread()
                break
            except (httpx.TransportError, WorkerStalled) as exc:
                upstream.add_in_flight(-1, self._clock())
                if attempt == 1 and self._fail_over(upstream, program_id, stalled=isinstance(exc, WorkerStalled)):
                    log.warning("worker %s failed (%r); retrying on another worker", upstream.id, exc)
                    continue
                self._finish_failed(program_id)
                raise BackendError(f"backend {upstream.id} ({upstream.url}) failed: {exc!r}") from exc
            finally:
                if response is not None and not (stream and response.status_code == 200):
                    await response.aclose()
        usage, tool = None, None
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                answered = json.loads(content)
                usage, tool = answered.get("usage"), tool_in_response(answered)
        self._finish(upstream, program_id, shape, usage, tool)
        media_type = response.headers.get("content-type", "application/json")
        return Relayed(response.status_code, media_type, content)

    async def _relay_stream(
        self,
        response: httpx.Response,
        upstream: Upstream,
        program_id: str | None,
        shape: PromptShape,
        client_wants_usage: bool,
        answer: StreamedAnswer,
    ) -> AsyncGenerator[bytes, None]:
        relay = StreamRelay(answer if program_id is not None else None, client_wants_usage, self._clock)
        try:
            async for data in reads(response):
                if relayed := relay.feed(data):
                    yield relayed
            if rest := relay.end():
                yield rest
        finally:
            # Runs on normal end, backend error and client disconnect alike: the slot is freed.
            await response.aclose()
            relay.settle()
            self._finish(upstream, program_id, shape, relay.usage, answer.tool, answer.ttft_s)

    def _fail_over(self, upstream: Upstream, program_id: str | None, stalled: bool) -> bool:
        """Take a worker that refused a connection out of scheduling (a stalled one is out already);
        is there another?"""
        if not stalled:
            self.mark_unhealthy(upstream)
        if program_id is not None:
            self.scheduler.requeue(program_id)
        return any(u.usable for u in self.upstreams.values())

    def _finish(
        self,
        upstream: Upstream,
        program_id: str | None,
        shape: PromptShape,
        usage: dict | None,
        tool: str | None = None,
        ttft_s: float | None = None,
    ) -> None:
        upstream.add_in_flight(-1, self._clock())
        if usage and usage.get("prompt_tokens"):
            self.estimator.observe(shape, usage["prompt_tokens"])
        if program_id is not None and usage and self.recorder is not None:
            self.recorder.on_usage(program_id, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        if usage and ttft_s:
            self.scheduler.observe_prefill(uncached_prompt_tokens(usage), ttft_s)
        account(self.scheduler, program_id, usage, tool)

    def _finish_failed(self, program_id: str | None) -> None:
        if program_id is not None:
            self.scheduler.on_request_failed(program_id)

    async def get_models(self) -> tuple[int, bytes]:
        upstream = self.least_loaded()
        try:
            response = await self._client.get(f"{upstream.url}/v1/models")
        except httpx.HTTPError as exc:
            raise BackendError(f"backend {upstream.id} ({upstream.url}) failed: {exc!r}") from exc
        return response.status_code, response.content

    # ---- views ----------------------------------------------------------------------------

    def programs_view(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [
            {
                "program_id": p.id,
                "phase": p.phase.value,
                "status": p.status.value,
                "backend": p.backend,
                "tokens": p.tokens,
                "steps": p.steps,
                "paused_s": round(p.paused_total_s + (now - p.paused_at if p.paused_at else 0), 3),
            }
            for p in self.scheduler.programs.values()
        ]
