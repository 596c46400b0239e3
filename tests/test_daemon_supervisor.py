"""The daemon's supervisor, through the real CLI on a cluster of one simulated worker (real processes,
real HTTP): it holds the gateway's port while a killed daemon is started again, backs off a daemon
that keeps dying and says why, is what `up` checks and starts again, and leaves nothing after `down`.

One cluster serves the module, its tests in the order of a cluster's life.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from support import Cli, RunningCluster, processes_mentioning, sim_profile, wait_for
from thunderctl.cluster.state import DaemonRecord
from thunderctl.daemon.supervisor import RESTART_INITIAL_BACKOFF_S, RESTART_MAX_BACKOFF_S
from thunderctl.processes import backoff_s, pid_alive, port_free

MODEL = "qwen3-32b"  # profiles/sim.yaml's served name
REQUEST = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


class Cluster(RunningCluster):
    def record(self) -> DaemonRecord:
        return DaemonRecord.load(self.state().daemon_record_file)

    @property
    def gateway(self) -> str:
        return self.cli.status().endpoint.removesuffix("/v1")

    def answers(self) -> bool:
        """Whether `status` gets the daemon's answer."""
        return self.cli.in_process("status", "--json").exit_code == 0


def simulated_cluster(directory: Path) -> tuple[Cli, Path, str]:
    name = f"supervised-{secrets.token_hex(3)}"
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump(sim_profile(name, 1, time_scale=0.1)))
    return Cli(directory / "state"), path, name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cli, profile, name = simulated_cluster(tmp_path_factory.mktemp("supervised"))
    cli("up", "-f", str(profile))
    yield Cluster(cli, profile, name)
    cli("down", check=False)


class Requests:
    """A client sending one request after another, each on a new connection, until stopped; what
    each ended in, counted."""

    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.outcomes: Counter[str] = Counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                response = httpx.post(f"{self.gateway}/v1/chat/completions", json=REQUEST, timeout=60)
                self.outcomes["ok" if response.status_code == 200 else f"HTTP {response.status_code}"] += 1
            except httpx.ConnectError:
                self.outcomes["not connected"] += 1  # refused: nothing listened on the port
            except httpx.HTTPError as exc:
                self.outcomes[type(exc).__name__] += 1  # cut: it was in flight when the daemon died

    def stop(self) -> Counter[str]:
        self.stopped.set()
        self.thread.join(timeout=120)
        return self.outcomes


@pytest.mark.slow
def test_a_killed_daemon_is_started_again_and_no_connection_is_refused_meanwhile(cluster: Cluster) -> None:
    first = cluster.cli.status().daemon_pid
    client = Requests(cluster.gateway)
    wait_for(lambda: client.outcomes["ok"] >= 5, 30, "answers before the kill")
    os.kill(first, signal.SIGKILL)
    answered_before = client.outcomes["ok"]
    wait_for(lambda: cluster.answers() and cluster.cli.status().daemon_pid != first, 60, "a new daemon")
    wait_for(lambda: client.outcomes["ok"] >= answered_before + 5, 60, "answers from the new daemon")
    outcomes = client.stop()

    assert outcomes["not connected"] == 0, outcomes
    status = cluster.cli.status()
    assert not pid_alive(first) and pid_alive(status.daemon_pid)
    assert status.daemon is not None and (status.daemon.restarts, status.daemon.last_exit) == (1, "killed by SIGKILL")
    assert "restarts 1 · last: killed by SIGKILL" in cluster.cli.in_process("status").stdout
    assert f"daemon (pid {first}) ended: killed by SIGKILL" in cluster.state().daemon_log.read_text()


@pytest.mark.slow
def test_up_after_the_supervisor_died_replaces_the_daemon_it_left_with_a_new_supervisor(cluster: Cluster) -> None:
    before, daemon = cluster.state(), cluster.cli.status().daemon_pid
    assert before.supervisor_pid is not None
    os.kill(before.supervisor_pid, signal.SIGKILL)  # its daemon runs on, alone
    wait_for(lambda: not pid_alive(before.supervisor_pid), 10, "the supervisor's end")
    up = cluster.cli("up", "-f", str(cluster.profile))
    assert "recovered" in up.stdout
    after = cluster.state()
    assert pid_alive(after.supervisor_pid) and after.supervisor_pid != before.supervisor_pid
    assert not pid_alive(daemon) and pid_alive(cluster.cli.status().daemon_pid)
    assert [w.pid for w in after.workers] == [w.pid for w in before.workers]  # the worker stayed up
    assert httpx.post(f"{cluster.gateway}/v1/chat/completions", json=REQUEST, timeout=60).status_code == 200


@pytest.mark.slow  # three failed starts with backoffs of 1 and 2 s between them, and the recovery
def test_a_daemon_that_keeps_dying_is_backed_off_reported_and_serves_once_it_can(cluster: Cluster) -> None:
    good = cluster.profile.read_text()
    unchanged = cluster.profile.with_name("unchanged.yaml")  # for `up`, which reads the profile it is given
    unchanged.write_text(good)
    cluster.profile.write_text(good + "not_a_field: 1\n")  # every new daemon dies reading it
    try:
        os.kill(cluster.cli.status().daemon_pid, signal.SIGKILL)
        # Each restart's wait, from the record as each new daemon starts: its start less the last end.
        waits: dict[int, float] = {}

        def third_restart_seen() -> bool:
            record = cluster.record()
            if (
                record.restarts
                and record.started_at
                and record.last_exit_at
                and record.started_at > record.last_exit_at
            ):
                waits[record.restarts] = record.started_at - record.last_exit_at
            return 3 in waits

        wait_for(third_restart_seen, 60, "three restarts")
        planned = [backoff_s(restart, RESTART_INITIAL_BACKOFF_S, RESTART_MAX_BACKOFF_S) for restart in range(3)]
        assert planned == [0, 1, 2]
        for restart, wait_s in sorted(waits.items()):
            assert wait_s >= planned[restart - 1], (restart, waits)  # never sooner than its backoff

        for result in (cluster.cli.in_process("status"), cluster.cli.in_process("up", "-f", str(unchanged))):
            assert result.exit_code == 1
            assert f"the daemon of {cluster.name} does not answer: it ended (exit code 1)" in result.stderr
            assert "not_a_field: unknown field" in result.stderr  # the end of its log: the daemon's traceback
    finally:
        cluster.profile.write_text(good)
    wait_for(cluster.answers, 60, "the next start, with the profile fixed")
    daemon = cluster.cli.status().daemon
    assert daemon is not None and daemon.restarts >= 4 and daemon.last_exit == "exit code 1"


@pytest.mark.slow
def test_down_leaves_no_supervisor_daemon_or_socket_behind(cluster: Cluster) -> None:
    state, status = cluster.state(), cluster.cli.status()
    port = int(status.endpoint.removesuffix("/v1").rsplit(":", 1)[1])
    pids = [state.supervisor_pid, status.daemon_pid, *(w.pid for w in state.workers)]
    assert all(pid_alive(pid) for pid in pids)
    cluster.cli("down")
    assert not any(pid_alive(pid) for pid in pids)
    assert port_free("127.0.0.1", port)  # nobody listens on the gateway's port
    assert not state.socket_path.exists() and not cluster.state_dir.exists()
    assert processes_mentioning(str(cluster.state_dir)) == []


@pytest.mark.slow
def test_up_with_the_gateways_port_taken_fails_saying_so_and_starts_nothing(tmp_path: Path) -> None:
    cli, profile, name = simulated_cluster(tmp_path)
    port = yaml.safe_load(profile.read_text())["gateway"]["port"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        up = cli.in_process("up", "-f", str(profile), "--skip-preflight")  # preflight would see the port taken
    assert up.exit_code == 1
    assert f"the daemon of {name} does not answer: its supervisor has exited" in up.stderr
    assert f"the gateway cannot listen on 127.0.0.1:{port}: Address already in use" in up.stderr
    assert "everything this `up` started has been stopped" in up.stderr
    assert processes_mentioning(str(tmp_path / "state")) == []
