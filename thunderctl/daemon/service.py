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
from thunderctl.cluster.state import ClusterState
from thunderctl.cluster.worker_key import read_worker_key
from thunderctl.daemon.control import build_control_app
from thunderctl.gateway import Gateway, Upstream, build_app
from thunderctl.gateway.gateway import AGENT_KEEPALIVE_S
from thunderctl.jsonapi import BodyLimits
from thunderctl.profile import ProfileError, load_profile
from thunderctl.sandbox import SandboxPool, render_sandbox_metrics, sandbox_routes
from thunderctl.scheduler import EventKind, ProgramEvent

log = logging.getLogger(__name__)


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


def bind_tcp(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class Daemon:
    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.profile = load_profile(Path(state.profile_path))
        upstreams = [Upstream(w.id, w.url, stopped=w.stopped) for w in state.workers]
        self.gateway = Gateway(upstreams, self.profile.scheduler, worker_key=read_worker_key(state.dir))
        self.auth = self.profile.gateway.auth()
        limits = BodyLimits(max_bytes=self.profile.gateway.max_body_bytes)
        self.started_at = time.time()
        self.server: uvicorn.Server | None = None
        self.sandboxes = self._sandbox_pool()
        self._background: set[asyncio.Task] = set()
        gateway_app = build_app(
            self.gateway,
            extra_routes=sandbox_routes(self.sandboxes, limits) if self.sandboxes else (),
            extra_metrics=(lambda: render_sandbox_metrics(self.sandboxes.stats())) if self.sandboxes else None,
            on_docker_ids=self._adopt if self.sandboxes else None,
            on_release=self._collect if self.sandboxes else None,
            auth=self.auth,
            limits=limits,
        )
        control_app = build_control_app(self)

        async def by_socket(scope: Scope, receive: Receive, send: Send) -> None:
            # One server, two sockets: a Unix-socket connection has no port, so only the
            # owner's control socket reaches the control API.
            server = scope.get("server")
            app = control_app if server is None or server[1] is None else gateway_app
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
        if event.kind is EventKind.EXPIRED:  # releases come through _collect
            self._collect(event.program.id)

    def _collect(self, program_id: str) -> None:
        self._spawn(self.sandboxes.program_ended(program_id))

    def _adopt(self, program_id: str, docker_ids: list[str]) -> None:
        self._spawn(self.sandboxes.adopt(program_id, docker_ids))

    async def _follow_resume_queue(self) -> None:
        """Prepare sandboxes in the order programs will get GPU memory."""
        while True:
            await asyncio.sleep(self.gateway.scheduler.config.tick_interval_s)
            self.sandboxes.program_queue([p.id for p in self.gateway.scheduler.resume_queue()])

    def sandbox_stats(self) -> dict:
        if self.sandboxes is None:
            return {"available": False, "reason": "no sandboxes in this profile", "warm": 0, "bound": 0, "preparing": 0}
        return self.sandboxes.stats()

    def request_exit(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def run(self) -> None:
        for warning in await self.gateway.start():
            log.warning(warning)
        if self.sandboxes is not None:
            await self.sandboxes.start()  # reaps what a crashed daemon left
            self._spawn(self._follow_resume_queue())
        gateway = self.profile.gateway
        sockets = [bind_tcp(gateway.host, gateway.port), bind_control_socket(self.state.socket_path)]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=AGENT_KEEPALIVE_S)
        self.server = uvicorn.Server(config)
        try:
            await self.server.serve(sockets=sockets)
        finally:
            for task in self._background:
                task.cancel()
            if self.sandboxes is not None:
                await self.sandboxes.shutdown()
            await self.gateway.stop()
            self.state.socket_path.unlink(missing_ok=True)


def main(state_dir: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state = ClusterState.load(state_dir)
    log.info("daemon of cluster %s starting (pid %d)", state.cluster, os.getpid())
    aio.run(Daemon(state).run())
    log.info("daemon of cluster %s stopped", state.cluster)


async def collect_orphaned_sandboxes(state: ClusterState) -> int:
    """`down` of a cluster whose daemon is dead: remove its sandboxes, which the daemon's pool
    would have reaped at its next start. Returns how many were removed."""
    try:
        config = load_profile(Path(state.profile_path)).sandboxes
    except ProfileError:
        return 0  # the profile is gone; nothing says which Docker hosts to clean
    if config is None or not config.enabled:
        return 0
    pool = SandboxPool(config.model_copy(update={"warm": 0, "warm_images": {}}), cluster=state.cluster,
                       state_path=state.dir / "sandboxes.json")
    await pool.start()  # its reaper removes this cluster's sandbox containers, never its workers
    await pool.shutdown()
    return pool.stats().get("reaped", 0)
