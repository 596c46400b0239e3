"""The control API, served on the daemon's Unix socket: status, drain, undrain, stop, revive, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from dataclasses import asdict
from typing import Any, Protocol

import psutil
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.state import ClusterState, DaemonRecord, WorkerRecord
from thunderctl.cluster.workers import stop_worker
from thunderctl.daemon.journal import Journal
from thunderctl.daemon.status import (
    ClusterStatus,
    DaemonStatus,
    GatewayStatus,
    GroupCounts,
    JournalStatus,
    PauseStatus,
    ProgramCounts,
    RelayStatus,
    SandboxStatus,
    SchedulerStatus,
    WorkerStatus,
)
from thunderctl.gateway import Gateway
from thunderctl.gateway.admin import NotNow, WeightSync
from thunderctl.gateway.auth import GatewayAuth
from thunderctl.gateway.views import groups_view
from thunderctl.jsonapi import BadRequest, BodyLimits, bad_request, error, read_json_object, read_json_options, shown
from thunderctl.scheduler import Phase, Status


class Daemon(Protocol):
    """What the control API reads and calls of the daemon that serves it (daemon/service.py)."""

    state: ClusterState
    gateway: Gateway
    weights: WeightSync
    auth: GatewayAuth
    journal: Journal
    started_at: float
    stopping: bool

    async def revive_workers(self, *, now: bool = False) -> list[str]: ...

    def sandbox_stats(self) -> dict: ...

    def relays(self) -> list[dict[str, Any]]: ...

    def request_exit(self) -> None: ...


DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0
MAX_SHUTDOWN_TIMEOUT_S = 86400.0


class UnknownTarget(LookupError):
    pass


def shutdown_timeout(body: dict[str, Any]) -> float:
    """Seconds `shutdown` lets requests in flight finish: a finite number, 0 to a day."""
    value = body.get("timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_SHUTDOWN_TIMEOUT_S:
        raise BadRequest(
            f"timeout must be a number of seconds from 0 to {MAX_SHUTDOWN_TIMEOUT_S:g}, not {shown(value)}"
        )
    return float(value)


def stop_one_worker(record: WorkerRecord) -> None:
    """On its own node, by its process group there (a remote pid means nothing here)."""
    with Transports() as transports:
        report = stop_worker(record, transports)
    record.stopped = report.ok
    if not report.ok:
        raise RuntimeError(f"worker {record.id}: {report.outcome}")


def resolve_target(daemon: Daemon, target: str) -> list[str]:
    """A worker id (`local/0`) or a node name (all its workers)."""
    ids = [w.id for w in daemon.state.workers]
    if target in ids:
        return [target]
    on_node = [w.id for w in daemon.state.workers if w.node == target]
    if on_node:
        return on_node
    raise UnknownTarget(f"no worker or node named {target!r}; workers: {', '.join(ids)}")


def cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU time so far, user and system (None: gone, or not ours to read)."""
    try:
        times = psutil.Process(pid).cpu_times() if pid is not None else None
    except psutil.Error:
        return None
    return round(times.user + times.system, 2) if times is not None else None


def status_view(daemon: Daemon) -> ClusterStatus:
    gateway, scheduler = daemon.gateway, daemon.gateway.scheduler
    workers = []
    for record in daemon.state.workers:
        link = gateway.links[record.id]
        metrics = link.metrics
        workers.append(
            WorkerStatus(
                id=record.id,
                node=record.node,
                url=record.url,
                state=gateway.worker_state(link),
                kv_capacity_tokens=link.capacity,
                kv_reserved_tokens=scheduler.reserved_tokens(record.id),
                programs_active=len(scheduler.workers[record.id].programs),
                requests_in_flight=link.in_flight,
                prefix_cache_hit_rate=metrics.prefix_cache_hit_rate if metrics else None,
                preemptions=metrics.preemptions if metrics else 0,
                requests_running=metrics.requests_running if metrics else 0,
                requests_waiting=metrics.requests_waiting if metrics else 0,
                restarts=record.restarts,
            )
        )
    counts = Counter("paused" if p.status is Status.PAUSED else p.phase.value for p in scheduler.programs.values())
    record = DaemonRecord.load(daemon.state.daemon_record_file)
    return ClusterStatus(
        cluster=daemon.state.cluster,
        endpoint=daemon.state.endpoint,
        uptime_s=round(time.time() - daemon.started_at, 1),
        daemon_pid=os.getpid(),
        daemon=DaemonStatus(
            restarts=record.restarts,
            last_exit=record.last_exit,
            last_exit_at=record.last_exit_at,
            journal=JournalStatus.model_validate(asdict(daemon.journal.stats)),
        ),  # fmt: skip
        gateway=GatewayStatus(
            api_key_set=daemon.auth.api_key is not None,
            metrics_public=daemon.auth.metrics_public,
            relays=[RelayStatus(**relay, cpu_s=cpu_seconds(relay["pid"])) for relay in daemon.relays()],
        ),
        workers=workers,
        scheduler=SchedulerStatus(
            programs=ProgramCounts(
                reasoning=counts[Phase.REASONING.value],
                acting=counts[Phase.ACTING.value],
                paused=counts["paused"],
                derived=gateway.derived.live(gateway.scheduler.programs),
            ),
            pauses_total=scheduler.counters.pauses,
            resumes_total=scheduler.counters.resumes,
            forced_resumes_total=scheduler.counters.forced_resumes,
            acting_weight=round(scheduler.acting_weight, 3),
            admission_gate_open=scheduler.tuner.gate_open,
            utilization=round(gateway.last_utilization, 3),
            groups=[GroupCounts.model_validate(group) for group in groups_view(gateway)],
        ),
        sandboxes=SandboxStatus.model_validate(daemon.sandbox_stats()),
        pause=PauseStatus.model_validate(daemon.weights.view()),
    )


def build_control_app(daemon: Daemon, limits: BodyLimits = BodyLimits()) -> Starlette:
    """The control routes; their bodies are bounded by `limits` as the gateway's are."""
    gateway = daemon.gateway

    async def targets_of(request: Request) -> list[str]:
        body = await read_json_object(request, limits)
        target = body.get("target")
        if not isinstance(target, str) or not target:
            raise BadRequest('expected {"target": "<worker id or node name>"}')
        return resolve_target(daemon, target)

    async def with_targets(request: Request, action) -> JSONResponse:
        try:
            worker_ids = await targets_of(request)
        except BadRequest as exc:
            return bad_request(exc)
        except UnknownTarget as exc:
            return error(404, str(exc), "not_found")
        for worker_id in worker_ids:
            await action(worker_id)
        return JSONResponse({"workers": worker_ids})

    async def status(_: Request) -> JSONResponse:
        return JSONResponse(status_view(daemon).wire())

    async def drain(request: Request) -> JSONResponse:
        async def act(worker_id: str) -> None:
            gateway.drain(worker_id)

        return await with_targets(request, act)

    async def undrain(request: Request) -> JSONResponse:
        async def act(worker_id: str) -> None:
            gateway.undrain(worker_id)

        return await with_targets(request, act)

    async def stop_workers(request: Request) -> JSONResponse:
        async def act(worker_id: str) -> None:
            gateway.mark_stopped(worker_id)
            record = daemon.state.worker(worker_id)
            await asyncio.to_thread(stop_one_worker, record)
            daemon.state.save()

        return await with_targets(request, act)

    async def revive(_: Request) -> JSONResponse:
        """Start again, now, every worker whose process died (not those stopped or draining)."""
        return JSONResponse({"restarted": await daemon.revive_workers(now=True)})

    async def shutdown(request: Request) -> JSONResponse:
        """Drain everything (bounded), release every program, then exit after answering."""
        try:
            timeout = shutdown_timeout(await read_json_options(request, limits))
        except BadRequest as exc:
            return bad_request(exc)
        daemon.stopping = True
        if daemon.weights.state.paused:  # what a `keep` pause froze must finish, and held requests go
            with contextlib.suppress(NotNow):  # it may have ended by itself meanwhile
                await daemon.weights.resume(weights_changed=False)
        worker_ids = [w.id for w in daemon.state.workers]
        for worker_id in worker_ids:
            gateway.drain(worker_id)
        deadline = time.monotonic() + timeout
        while not _quiet_in_flight(daemon) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        drained = _quiet_in_flight(daemon)
        program_ids = list(gateway.scheduler.programs)
        for program_id in program_ids:
            gateway.scheduler.release(program_id)
        return JSONResponse(
            {"drained": drained, "released": len(program_ids)},
            background=BackgroundTask(daemon.request_exit),
        )

    return Starlette(
        routes=[
            Route("/status", status, methods=["GET"]),
            Route("/drain", drain, methods=["POST"]),
            Route("/undrain", undrain, methods=["POST"]),
            Route("/workers/stop", stop_workers, methods=["POST"]),
            Route("/workers/revive", revive, methods=["POST"]),
            Route("/shutdown", shutdown, methods=["POST"]),
        ]
    )


def _quiet_in_flight(daemon: Daemon) -> bool:
    return all(u.in_flight == 0 for u in daemon.gateway.links.values())
