"""No signal to a stranger: a recorded pid is signalled only while it is still the process that was
started, told by its start time, on this machine and on an SSH node (the real sshd of ssh_fixtures).

The stranger is a real process: a `sleep` leading a group of its own, as a worker would, whose pid
the state records with another start time, as a reused pid would look.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from support import Cli, live_group_members, wait_for
from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.cluster.transport import SshTarget
from thunderctl.cluster.workers import any_worker_alive, stop_worker

if TYPE_CHECKING:
    from ssh_fixtures import SshNodes

NODE = "127.0.0.2"
# A leader and a child in its group, as a vLLM server and its engine core.
GROUP_COMMAND = ["sh", "-c", "sleep 600 & sleep 600"]


def start_ticks_of(pid: int) -> int:
    """Field 22 of /proc/PID/stat; read apart from the code under test, which must not be trusted."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text.rsplit(")", 1)[1].split()[19])


@pytest.fixture
def stranger() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start unrelated `sleep`s, each the leader of its own group; killed by pid afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(["sleep", "600"], start_new_session=True)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def worker_at(pid: int, start_ticks: int | None, log_path: Path, ssh: SshTarget | None = None) -> WorkerRecord:
    return WorkerRecord("local/0", "local", "http://127.0.0.1:1", pid, str(log_path), ssh=ssh, start_ticks=start_ticks)


def test_a_worker_started_and_recorded_is_stopped_with_its_group(tmp_path: Path) -> None:
    with Transports() as transports:
        process = transports.to(None).start_detached(GROUP_COMMAND, {}, str(tmp_path / "w.log"))
        assert process.start_ticks == start_ticks_of(process.pid)
        assert (tmp_path / "w.pid").read_text() == f"{process.pid} {process.start_ticks}\n"
        wait_for(lambda: len(live_group_members(process.pid)) > 1, 10, "the group's child")
        worker = worker_at(process.pid, process.start_ticks, tmp_path / "w.log")
        assert any_worker_alive(state_with(tmp_path, worker), transports)

        report = stop_worker(worker, transports)
    assert (report.ok, report.outcome) == (True, "stopped")
    assert live_group_members(process.pid) == {}


def test_down_leaves_a_stranger_on_every_recorded_pid_alive(tmp_path: Path, stranger) -> None:
    worker_pid, tunnel_pid, supervisor_pid = stranger(), stranger(), stranger()
    root = tmp_path / "state"
    worker = worker_at(worker_pid.pid, start_ticks_of(worker_pid.pid) + 1, tmp_path / "w.log")
    worker.tunnel_pid, worker.tunnel_start_ticks = tunnel_pid.pid, start_ticks_of(tunnel_pid.pid) + 1
    state = ClusterState(
        "local",
        root / "local",
        str(tmp_path / "no-profile.yaml"),
        "http://127.0.0.1:1/v1",
        workers=[worker],
        supervisor_pid=supervisor_pid.pid,
        supervisor_start_ticks=start_ticks_of(supervisor_pid.pid) + 1,
    )
    state.save()
    with Transports() as transports:
        assert not any_worker_alive(state, transports)  # so `up` would not "recover" a stranger

    down = Cli(root).in_process("down")
    assert down.exit_code == 0, down.output
    assert f"local/0 already stopped (pid {worker_pid.pid} now belongs to another process)" in down.stdout
    assert f"its tunnel had ended (pid {tunnel_pid.pid} now belongs to another process)" in down.stdout
    for process in (worker_pid, tunnel_pid, supervisor_pid):
        assert process.poll() is None and live_group_members(process.pid) == {process.pid: "sleep"}
    assert not state.dir.exists()  # nothing of the cluster was left running: its state is gone


def test_a_state_from_before_start_times_loads_and_still_stops_its_worker(tmp_path: Path) -> None:
    with Transports() as transports:
        process = transports.to(None).start_detached(GROUP_COMMAND, {}, str(tmp_path / "w.log"))
        state = state_with(tmp_path, worker_at(process.pid, process.start_ticks, tmp_path / "w.log"))
        older = asdict(state) | {"dir": str(state.dir)}
        # Before the supervisor, the state named the daemon, without its start time.
        older["daemon_pid"] = older.pop("supervisor_pid")
        del older["supervisor_start_ticks"]
        for record in older["workers"]:
            del record["start_ticks"], record["tunnel_start_ticks"]
        state.dir.mkdir(parents=True)
        state.state_file.write_text(json.dumps(older))

        [loaded] = ClusterState.load(state.dir).workers
        assert loaded.start_ticks is None
        report = stop_worker(loaded, transports)
    assert (report.ok, report.outcome) == (True, "stopped")
    assert live_group_members(process.pid) == {}


def state_with(directory: Path, worker: WorkerRecord) -> ClusterState:
    return ClusterState("c", directory / "c", str(directory / "p.yaml"), "http://127.0.0.1:1/v1", workers=[worker])


def test_over_ssh_a_recorded_worker_is_stopped_and_a_stranger_is_spared(
    ssh_nodes: SshNodes, tmp_path: Path, stranger
) -> None:
    target = SshTarget(NODE, ssh_nodes.port, ssh_nodes.user, str(ssh_nodes.key))
    log_path = tmp_path / "node" / "w.log"  # the node is this machine: its paths are ours
    with Transports() as transports:
        node = transports.to(target)
        process = node.start_detached(GROUP_COMMAND, {}, str(log_path))
        # Read on the node and here, it is one clock: the node's own /proc.
        assert process.start_ticks == start_ticks_of(process.pid)
        wait_for(lambda: len(live_group_members(process.pid)) > 1, 10, "the group's child")
        worker = worker_at(process.pid, process.start_ticks, log_path, ssh=target)
        assert node.group_alive(worker.process)
        assert stop_worker(worker, transports).outcome == "stopped"
        assert live_group_members(process.pid) == {}

        other = stranger()
        reused = worker_at(other.pid, start_ticks_of(other.pid) + 1, log_path, ssh=target)
        assert not node.group_alive(reused.process)
        assert not any_worker_alive(state_with(tmp_path, reused), transports)
        report = stop_worker(reused, transports)
        assert (report.ok, report.outcome) == (
            True,
            f"already stopped (pid {other.pid} now belongs to another process)",
        )
        assert other.poll() is None and live_group_members(other.pid) == {other.pid: "sleep"}
        # The same pid recorded with its true start time is the worker's: that one is stopped.
        owned = worker_at(other.pid, start_ticks_of(other.pid), log_path, ssh=target)
        assert node.group_alive(owned.process)
        assert stop_worker(owned, transports).outcome == "stopped"
        assert other.wait(timeout=10) is not None
