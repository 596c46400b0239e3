"""The control API's client: an HTTP client on the daemon's Unix socket, and its `/status` read as a model."""

from __future__ import annotations

import httpx

from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.status import ClusterStatus


def control_client(state: ClusterState, timeout: float = 30.0) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=str(state.socket_path))
    return httpx.Client(transport=transport, base_url="http://thunderctl", timeout=timeout)


def daemon_answers(state: ClusterState) -> bool:
    if not state.socket_path.exists():
        return False
    try:
        with control_client(state, timeout=5) as client:
            return client.get("/status").status_code == 200
    except httpx.HTTPError:
        return False


def fetch_status(state: ClusterState, timeout: float = 30.0) -> ClusterStatus:
    """The daemon's `/status`; raises httpx.HTTPError when it does not answer with one."""
    with control_client(state, timeout=timeout) as client:
        return ClusterStatus.model_validate(client.get("/status").raise_for_status().json())
