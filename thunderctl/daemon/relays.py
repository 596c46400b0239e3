"""A relay process: the gateway's byte path on a core of its own (profile: `gateway.relays`).

It accepts on the gateway's listening socket, which it inherits from the supervisor as the daemon
does, and serves the engines' routes itself (`gateway.app.relay_routes`): it parses each request,
hashes it for identity, relays its answer's bytes and reads its usage and tool at the end. What
the scheduler decides it asks the daemon in messages (`gateway/remote.py`) on the state
directory's relays socket. Every other route (/programs, /metrics, /admin, the sandboxes', a
stored Responses answer) it hands whole to the daemon's own gateway on the gateway socket.

Without RELAY it is a spare: it imports all it needs (most of a relay's start-up), then waits for
its number on stdin, so that the supervisor can replace a relay that died in the time the spare
takes to connect rather than an interpreter's start (daemon/supervisor.py).

`python -m thunderctl.daemon.relays STATE_DIR FD [RELAY]`
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from thunderctl import aio
from thunderctl.cluster.state import ClusterState
from thunderctl.cluster.worker_key import read_worker_key
from thunderctl.gateway.answers import resume_priority
from thunderctl.gateway.app import relay_app
from thunderctl.gateway.gateway import WORKER_CONNECT_TIMEOUT_S, WORKER_KEEPALIVE_S
from thunderctl.gateway.relay import Relay
from thunderctl.gateway.remote import HOLD_S, RECONNECT_S, RemoteAdmissions
from thunderctl.gateway.server import server_config
from thunderctl.gateway.transport import HOP_BY_HOP as TRANSPORT_HOP_BY_HOP
from thunderctl.gateway.transport import AiohttpTransport, worker_client
from thunderctl.jsonapi import BodyLimits, error
from thunderctl.profile import load_profile

log = logging.getLogger("thunderctl.daemon.relays")

# Headers that belong to one hop (and the host, the daemon's own); the daemon's gateway gets the
# rest of the client's as they came.
HOP_BY_HOP = TRANSPORT_HOP_BY_HOP | {"host"}


class RelayProcess:
    """Relay number `relay` of the cluster whose state is `state`."""

    def __init__(self, state: ClusterState, relay: int) -> None:
        profile = load_profile(Path(state.profile_path))
        self.number = relay
        self.state = state
        transport = AiohttpTransport(WORKER_KEEPALIVE_S)
        self._client = worker_client(transport, read_worker_key(state.dir), WORKER_CONNECT_TIMEOUT_S)
        workers = [(w.id, w.url) for w in state.workers if not w.stopped]
        self.admissions = RemoteAdmissions(state.relays_socket_path, relay, workers, self._give_up)
        self.relay = Relay(
            self.admissions, self._client, transport, time.monotonic, resume_priority(profile.engine.args)
        )
        # The daemon's own gateway, for every route a relay does not serve.
        self._daemon = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(state.gateway_socket_path)),
            base_url="http://daemon",
            timeout=httpx.Timeout(None, connect=WORKER_CONNECT_TIMEOUT_S),
        )
        auth = profile.gateway.auth()
        limits = BodyLimits(max_bytes=profile.gateway.max_body_bytes)
        self.backlog = profile.gateway.backlog
        self.app = relay_app(
            self.relay, self._to_daemon, self.admissions.adopt, self.admissions.release, self.admissions.client_gone,
            auth, limits,
        )  # fmt: skip

    def _give_up(self, worker: str) -> int:
        given_up = self.relay.give_up(worker)
        if given_up:
            log.warning("relay %d: worker %s stalled; %d unanswered request(s) go again", self.number, worker, given_up)
        return given_up

    async def _to_daemon(self, request: Request) -> Response:
        """A route the daemon serves, handed to it whole; its answer streamed back as it comes."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        outgoing = self._daemon.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=await request.body()
        )
        deadline = time.monotonic() + HOLD_S
        while True:
            try:
                answer = await self._daemon.send(outgoing, stream=True)
                break
            except httpx.ConnectError as exc:  # it never reached the daemon: held while one starts again
                if time.monotonic() >= deadline:
                    return error(503, f"the gateway's daemon does not answer (restarting?): {exc!r}", "unavailable")
                await asyncio.sleep(RECONNECT_S)
            except httpx.HTTPError as exc:
                return error(502, f"the gateway's daemon failed the request: {exc!r}", "backend_error")
        answer_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(
            answer.aiter_raw(), answer.status_code, headers=answer_headers, background=BackgroundTask(answer.aclose)
        )

    async def run(self, listener: socket.socket) -> None:
        await self.admissions.start()
        server = uvicorn.Server(server_config(self.app, backlog=self.backlog))
        try:
            await server.serve(sockets=[listener])
        finally:
            await self.admissions.stop()
            await self.close()

    async def close(self) -> None:
        await self._client.aclose()
        await self._daemon.aclose()


async def warm_up(state: ClusterState) -> None:
    """A spare's dry start: what a relay's start imports on first use (httpx's transports, uvicorn's
    protocols, the event loop) is imported while the spare waits for its number, not after it."""
    relay = RelayProcess(state, 0)
    server_config(relay.app).load()
    await relay.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m thunderctl.daemon.relays")
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("fd", type=int, help="the gateway's bound, listening socket")
    parser.add_argument(
        "relay", type=int, nargs="?", help="this relay's number (1, 2, …); none: a spare, told it on stdin"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.relay is None:
        aio.run(warm_up(ClusterState.load(args.state_dir)))
        line = sys.stdin.readline()
        if not line:
            return  # its supervisor ended before it was needed
        args.relay = int(line)
    state = ClusterState.load(args.state_dir)
    log.info("relay %d of cluster %s starting (pid %d)", args.relay, state.cluster, os.getpid())
    aio.run(RelayProcess(state, args.relay).run(socket.socket(fileno=args.fd)))


if __name__ == "__main__":
    main(sys.argv[1:])
