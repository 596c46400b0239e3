"""The gateway's uvicorn settings reach the socket agents connect to: its listen queue."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
import uvicorn
from starlette.applications import Starlette

from thunderctl.gateway.server import AGENT_BACKLOG, server_config
from thunderctl.processes import pick_free_port
from thunderctl.profile import GatewaySpec


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def listen_queue(port: int) -> int:
    """The listen backlog of the socket on 127.0.0.1:`port`, as `ss` reports it (its Send-Q)."""
    listing = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    (line,) = listing.splitlines()
    return int(line.split()[2])


@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a socket's backlog")
async def test_the_backlog_setting_is_the_listen_queue_agents_connect_into() -> None:
    port = pick_free_port()
    server = uvicorn.Server(server_config(Starlette(), backlog=333, host="127.0.0.1", port=port))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        assert listen_queue(port) == 333
    finally:
        server.should_exit = True
        await serving


def test_a_profile_queues_more_connections_than_uvicorns_default() -> None:
    assert GatewaySpec().backlog == AGENT_BACKLOG > uvicorn.Config(Starlette()).backlog
    with pytest.raises(ValueError, match="backlog"):
        GatewaySpec(backlog=8)
