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

from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.control import build_control_app
from thunderctl.gateway import Gateway, Upstream, build_app
from thunderctl.profile import load_profile

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
        self.gateway = Gateway(upstreams, self.profile.scheduler)
        self.started_at = time.time()
        self.server: uvicorn.Server | None = None
        gateway_app = build_app(self.gateway)
        control_app = build_control_app(self)

        async def by_socket(scope: Scope, receive: Receive, send: Send) -> None:
            # One server, two sockets: a Unix-socket connection has no port, so only the
            # owner's control socket reaches the control API.
            server = scope.get("server")
            app = control_app if server is None or server[1] is None else gateway_app
            await app(scope, receive, send)

        self.app = by_socket

    def request_exit(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def run(self) -> None:
        for warning in await self.gateway.start():
            log.warning(warning)
        gateway = self.profile.gateway
        sockets = [bind_tcp(gateway.host, gateway.port), bind_control_socket(self.state.socket_path)]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        try:
            await self.server.serve(sockets=sockets)
        finally:
            await self.gateway.stop()
            self.state.socket_path.unlink(missing_ok=True)


def main(state_dir: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state = ClusterState.load(state_dir)
    log.info("daemon of cluster %s starting (pid %d)", state.cluster, os.getpid())
    asyncio.run(Daemon(state).run())
    log.info("daemon of cluster %s stopped", state.cluster)
