"""The daemon process: one asyncio loop serving the gateway (TCP) and the control API (Unix socket)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path

import uvicorn
from starlette.types import Receive, Scope, Send

from thunderctl import aio
from thunderctl.cluster.host_kv import counted_host_kv_tokens
from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.plan import plan_workers
from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.cluster.transport import TransportError
from thunderctl.cluster.worker_key import read_worker_key
from thunderctl.cluster.workers import revive_worker
from thunderctl.daemon.control import build_control_app
from thunderctl.daemon.journal import Journal
from thunderctl.daemon.restarts import RestartPlanner
from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.admin import WeightSync
from thunderctl.gateway.answers import resume_priority
from thunderctl.gateway.remote import AdmissionsServer
from thunderctl.gateway.server import server_config
from thunderctl.jsonapi import BodyLimits
from thunderctl.processes import process_alive
from thunderctl.profile import ProfileError, load_profile
from thunderctl.sandbox import (
    SandboxConfig,
    SandboxError,
    SandboxPool,
    Sweep,
    render_sandbox_metrics,
    sandbox_routes,
)
from thunderctl.sandbox.state import PoolState
from thunderctl.scheduler import EventKind, ProgramEvent

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 2.0  # how often the daemon checks that its workers' processes still run


def bind_control_socket(path: Path) -> socket.socket:
    """A Unix socket only its owner may use (uvicorn's own binding makes it 0666)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    return sock


class Daemon:
    """`relays` ≥ 2: that many relay processes accept the gateway's connections (daemon/relays.py)
    and the daemon schedules for them, serving the routes they hand it on its gateway socket."""

    def __init__(self, state: ClusterState, relays: int = 1) -> None:
        self.state = state
        self.profile = load_profile(Path(state.profile_path))
        links = [
            WorkerLink(w.id, w.url, stopped=w.stopped, host_kv_tokens=counted_host_kv_tokens(self.profile, w.node))
            for w in state.workers
        ]
        self.worker_key = read_worker_key(state.dir)
        self.gateway = Gateway(
            links, self.profile.scheduler, worker_key=self.worker_key,
            resumed_priority=resume_priority(self.profile.engine.args),
            identity=self.profile.gateway.identity(),
        )  # fmt: skip
        self.auth = self.profile.gateway.auth()
        self.weights = WeightSync(self.gateway, self.profile.admin)
        limits = BodyLimits(max_bytes=self.profile.gateway.max_body_bytes)
        self.started_at = time.time()
        self.server: uvicorn.Server | None = None
        self.sandboxes = self._sandbox_pool()
        self._background: set[asyncio.Task] = set()
        self.plans = {plan.id: plan for plan in plan_workers(self.profile)}
        self.restarts = RestartPlanner(self.profile.engine.restart)
        self.transports = Transports()
        self._reviving = asyncio.Lock()
        self.stopping = False  # set by shutdown: a worker that ends then is not started again
        self.journal = Journal(state.journal_file)
        gateway_app = build_app(
            self.gateway,
            extra_routes=sandbox_routes(self.sandboxes, limits) if self.sandboxes else (),
            extra_metrics=(lambda: render_sandbox_metrics(self.sandboxes.stats())) if self.sandboxes else None,
            on_docker_ids=self._adopt if self.sandboxes else None,
            on_release=self._collect if self.sandboxes else None,
            auth=self.auth,
            limits=limits,
            weight_sync=self.weights,
        )
        control_app = build_control_app(self, limits)
        self.relay_server = (
            AdmissionsServer(self.gateway, state.relays_socket_path, self._release, self._adopt if self.sandboxes else None)
            if relays > 1 else None
        )  # fmt: skip
        relayed_from = str(state.gateway_socket_path)

        async def by_socket(scope: Scope, receive: Receive, send: Send) -> None:
            # One server, its sockets told apart: a Unix-socket connection has no port, so only the
            # owner's control socket reaches the control API, and the relays' gateway socket the gateway.
            server = scope.get("server")
            relayed = server is not None and server[1] is None and server[0] == relayed_from
            app = control_app if (server is None or server[1] is None) and not relayed else gateway_app
            await app(scope, receive, send)

        self.app = by_socket

    def _sandbox_pool(self) -> SandboxPool | None:
        config = self.profile.sandboxes
        if config is None or not config.enabled:
            return None
        pool = SandboxPool(config, cluster=self.state.cluster, state_path=self.state.dir / "sandboxes.json")
        # The scheduler owns program lifecycles; the pool follows them (it never imports it).
        self.gateway.scheduler.listeners.append(self._on_program_event)
        return pool

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)  # keep a reference until done
        task.add_done_callback(self._background.discard)

    def _on_program_event(self, event: ProgramEvent) -> None:
        if event.kind is EventKind.CREATED:
            self.sandboxes.program_began(event.program.id)
        elif event.kind is EventKind.EXPIRED:  # releases come through _collect
            self._collect(event.program.id)

    def _release(self, program_id: str) -> None:
        """A relay process's session ended with its last request: as POST /programs/release."""
        self.gateway.scheduler.release(program_id)
        if self.sandboxes is not None:
            self._collect(program_id)

    def _collect(self, program_id: str) -> None:
        self._spawn(self.sandboxes.program_ended(program_id))

    def _adopt(self, program_id: str, docker_ids: list[str]) -> None:
        self.sandboxes.program_began(program_id)  # before the request reaches the scheduler

        async def adopt() -> None:
            # The LLM request goes on whatever the answer; a refusal is the operator's to see.
            try:
                await self.sandboxes.adopt(program_id, docker_ids)
            except SandboxError as exc:
                log.warning("docker_ids of program %r not adopted: %s", program_id, exc)

        self._spawn(adopt())

    async def _follow_resume_queue(self) -> None:
        """Prepare sandboxes in the order programs will get GPU memory."""
        while True:
            await asyncio.sleep(self.gateway.scheduler.config.tick_interval_s)
            self.sandboxes.program_queue([p.id for p in self.gateway.scheduler.resume_queue()])

    async def _supervise_workers(self) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            try:
                await self.revive_workers()
            except TransportError as exc:  # a node out of reach now may answer at the next check
                log.warning("cannot check the workers: %s", exc)

    async def revive_workers(self, *, now: bool = False) -> list[str]:
        """Start again the workers whose process died, as the restart policy allows, or all of
        them at once with `now` (what `up` asks of a running cluster). Returns their ids."""
        async with self._reviving:
            revived = await asyncio.to_thread(self._revive_due, now)
        for worker_id in revived:  # on the loop: the gateway and its scheduler are not thread-safe
            # Nothing serves there until the new engine answers; the gateway takes it back then.
            self.gateway.restarting(worker_id)
        return revived

    def _revive_due(self, now: bool) -> list[str]:
        revived = []
        for worker in self.state.workers:
            link = self.gateway.links[worker.id]
            # Stopped or draining on purpose: the operator took it out of service.
            if self.stopping or worker.stopped or link.stopped or link.draining or worker.id not in self.plans:
                continue
            if self._revive(worker, link.healthy, now):
                revived.append(worker.id)
        if revived:
            self.state.save()
        return revived

    def _revive(self, worker: WorkerRecord, healthy: bool, now: bool) -> bool:
        transport = self.transports.to(worker.ssh)
        alive = transport.group_alive(worker.process)
        clock = time.monotonic()
        due = self.restarts.should_restart(worker.id, alive=alive, healthy=healthy, now_s=clock) or (now and not alive)
        tunnel_ended = worker.tunnel is not None and not process_alive(worker.tunnel)
        if not (due or tunnel_ended):
            return False
        restarted = revive_worker(self.state, worker, self.plans[worker.id], transport, self.worker_key)
        if restarted:
            self.restarts.restarted(worker.id, clock)
            worker.restarts += 1
            log.warning(
                "worker %s had exited; started it again (restart %d; log %s)",
                worker.id,
                worker.restarts,
                worker.log_path,
            )
        return restarted

    def sandbox_stats(self) -> dict:
        if self.sandboxes is None:
            return {"available": False, "reason": "no sandboxes in this profile", "warm": 0, "bound": 0, "preparing": 0}
        return self.sandboxes.stats()

    def relays(self) -> list[dict]:
        """Each relay process connected now (none: the daemon relays in its own process)."""
        return self.relay_server.relays() if self.relay_server is not None else []

    def request_exit(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def run(self, listener: socket.socket) -> None:
        """Serve the gateway on `listener` (bound and listening, held by the supervisor as well) and the
        control API on the state directory's socket, until asked to exit."""
        for warning in await self._start_gateway():
            log.warning(warning)
        self._spawn(self.journal.run(self.gateway, self.gateway.scheduler.config.tick_interval_s))
        if self.sandboxes is not None:
            # The sandboxes of the programs restored from the journal are bound again; the rest
            # of what a crashed daemon left is reaped.
            await self.sandboxes.start(live_programs=list(self.gateway.scheduler.programs))
            self._spawn(self._follow_resume_queue())
        self._spawn(self._supervise_workers())
        sockets = [bind_control_socket(self.state.socket_path)]
        if self.relay_server is None:
            sockets.append(listener)
        else:  # the relays accept on the listener; they ask the scheduler here, the rest there
            await self.relay_server.start()
            sockets.append(bind_control_socket(self.state.gateway_socket_path))
        self.server = uvicorn.Server(server_config(self.app, backlog=self.profile.gateway.backlog))
        try:
            await self.server.serve(sockets=sockets)
        finally:
            for task in self._background:
                task.cancel()
            if self.relay_server is not None:
                await self.relay_server.stop()
                self.state.gateway_socket_path.unlink(missing_ok=True)
            if self.sandboxes is not None:
                await self.sandboxes.shutdown()
            await self.weights.stop()
            await self.gateway.stop()
            self.transports.close()
            self.journal.close()
            self.state.socket_path.unlink(missing_ok=True)

    async def _start_gateway(self) -> list[str]:
        """Start the gateway from what the daemon before this one left in the journal, if any."""
        restored = self.journal.load()
        if restored is None:
            return await self.gateway.start()
        try:
            warnings = await self.gateway.start(restored)
        except Exception:
            # Not again: the next daemon starts without it rather than dying on it too.
            aside = self.journal.set_aside()
            log.exception("the journal could not be restored; moved to %s, the next daemon starts without it", aside)
            raise
        programs = len(restored.scheduler.programs)
        log.info("restored %d program(s) from the journal, written %.1f s before", programs, restored.elapsed_s)
        return warnings


def main(state_dir: Path, listen_fd: int, relays: int = 1) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state = ClusterState.load(state_dir)
    log.info("daemon of cluster %s starting (pid %d)", state.cluster, os.getpid())
    aio.run(Daemon(state, relays).run(socket.socket(fileno=listen_fd)))
    log.info("daemon of cluster %s stopped", state.cluster)


async def collect_orphaned_sandboxes(state: ClusterState) -> Sweep:
    """`down`, once the daemon has exited: remove the cluster's sandboxes it left (a daemon that
    died, or Docker that did not answer its shutdown), as its pool would at its next start, on
    the profile's hosts and every host the state file records (the profile may be gone)."""
    recorded = PoolState.load(state.dir / "sandboxes.json").hosts_to_sweep()
    try:
        config: SandboxConfig | None = load_profile(Path(state.profile_path)).sandboxes
    except ProfileError:
        config = None  # gone or broken: the recorded hosts are still known
    configured = config.hosts if config is not None and config.enabled else []
    hosts = list(dict.fromkeys([*configured, *recorded]))
    if not hosts:
        return Sweep(0, [])
    pool = SandboxPool(
        (config or SandboxConfig()).model_copy(update={"enabled": True, "hosts": hosts, "warm": 0, "warm_images": {}}),
        cluster=state.cluster,
        state_path=state.dir / "sandboxes.json",
    )
    return await pool.sweep()  # its reaper removes this cluster's sandbox containers, never its workers
