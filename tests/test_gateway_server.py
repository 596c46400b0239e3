"""The gateway's uvicorn settings reach the socket agents connect to: its listen queue."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvicorn
from starlette.applications import Starlette

from support import accept_queue, connect_unaccepted
from thunderctl.gateway.server import AGENT_BACKLOG, server_config
from thunderctl.processes import pick_free_port
from thunderctl.profile import GatewaySpec


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def fill_without_accepting(port: int, connections: int, backlog: int) -> int:
    """Connect `connections` times while the server's event loop is held (this function never
    yields to it), and return how many the kernel queued: a full queue takes no more."""
    sockets = connect_unaccepted(port, connections)
    try:
        # Loopback handshakes complete at once; wait out any the kernel has yet to finish.
        deadline = time.monotonic() + 10
        while accept_queue(port) < backlog + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return accept_queue(port)
    finally:
        for client in sockets:
            client.close()


@pytest.mark.anyio
async def test_the_backlog_setting_is_the_listen_queue_agents_connect_into() -> None:
    port, backlog = pick_free_port(), 50
    server = uvicorn.Server(server_config(Starlette(), backlog=backlog, host="127.0.0.1", port=port))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        # Linux queues one more than the backlog passed to listen(); the rest wait on their SYNs.
        assert fill_without_accepting(port, backlog + 30, backlog) == backlog + 1
    finally:
        server.should_exit = True
        await serving


def test_a_profile_queues_more_connections_than_uvicorns_default() -> None:
    assert GatewaySpec().backlog == AGENT_BACKLOG > uvicorn.Config(Starlette()).backlog
    with pytest.raises(ValueError, match="backlog"):
        GatewaySpec(backlog=8)
