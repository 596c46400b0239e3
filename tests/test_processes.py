"""Process groups, pid identity, polling, ports and log tails, on real subprocesses of this machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import live_group_members, wait_for
from thunderctl.processes import (
    GroupStop,
    LocalProcessGroups,
    ProcessIdentity,
    StopError,
    pick_free_ports,
    pid_alive,
    poll_until,
    port_free,
    process_alive,
    spawn_detached,
    start_ticks_in,
    stop_recorded_group,
    tail_of_file,
)

# A leader and a child in its group (as a vLLM server and its engine core), both deaf to SIGTERM:
# an ignored signal stays ignored across fork and exec.
DEAF_GROUP = [sys.executable, "-c",
              "import signal, subprocess, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "subprocess.Popen(['sleep', '600'])\n"
              "print('ready', flush=True)\n"
              "time.sleep(600)\n"]  # fmt: skip
GROUP = ["sh", "-c", "sleep 600 & sleep 600"]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[list[str]], subprocess.Popen[bytes]]]:
    """Start commands as leaders of their own groups; whatever is left is SIGKILLed by group."""
    started: list[subprocess.Popen[bytes]] = []

    def start(command: list[str]) -> subprocess.Popen[bytes]:
        process = spawn_detached(command, {"PATH": "/usr/bin:/bin"}, tmp_path / f"{len(started)}.log")
        started.append(process)
        wait_for(lambda: len(live_group_members(process.pid)) > 1, 10, f"the child in the group of {command}")
        return process

    yield start
    for process in started:
        signal_group_kill(process.pid)
        process.wait()


def signal_group_kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_group_that_ends_on_sigterm_is_not_killed(spawn) -> None:
    process = spawn(GROUP)
    GroupStop(term_wait_s=10).stop(process.pid, LocalProcessGroups())
    assert live_group_members(process.pid) == {}
    assert process.wait(5) == -signal.SIGTERM


def test_a_group_that_ignores_sigterm_is_killed_after_the_wait(spawn) -> None:
    process = spawn(DEAF_GROUP)
    GroupStop(term_wait_s=0.5).stop(process.pid, LocalProcessGroups())
    assert live_group_members(process.pid) == {}
    assert process.wait(5) == -signal.SIGKILL


def test_stopping_a_group_that_has_ended_signals_nothing_and_succeeds(spawn) -> None:
    process = spawn(GROUP)
    signal_group_kill(process.pid)
    process.wait(5)
    wait_for(lambda: live_group_members(process.pid) == {}, 10, "the group to end")
    GroupStop(term_wait_s=0.1).stop(process.pid, LocalProcessGroups())


class UnkillableGroups:
    """A group whose members outlive every signal, which no real process here can do."""

    description = "a test node"
    poll_s = 0.01

    def __init__(self) -> None:
        self.signals: list[signal.Signals] = []

    def start_ticks(self, pid: int) -> int | None:
        return 42

    def signal_group(self, pgid: int, sig: signal.Signals) -> bool:
        self.signals.append(sig)
        return True

    def group_members(self, pgid: int) -> list[int]:
        return [pgid, pgid + 1]


def test_members_that_survive_sigkill_are_an_error_naming_them_and_the_node() -> None:
    groups = UnkillableGroups()
    with pytest.raises(StopError, match=r"processes \[700, 701\] of group 700 on a test node survived SIGKILL"):
        GroupStop(term_wait_s=0.05, kill_wait_s=0.05).stop(700, groups)
    assert groups.signals == [signal.SIGTERM, signal.SIGKILL]


def test_a_recorded_leader_whose_pid_another_process_now_holds_is_not_signalled(spawn) -> None:
    process = spawn(GROUP)
    now = ProcessIdentity.local(process.pid)
    assert now.start_ticks is not None
    recorded = ProcessIdentity(process.pid, now.start_ticks - 1)  # as the pid's earlier owner would be
    members = live_group_members(process.pid)
    assert not stop_recorded_group(recorded, timeout=1)
    assert process.poll() is None and live_group_members(process.pid) == members


def test_a_pid_whose_start_time_differs_is_not_the_recorded_process(spawn) -> None:
    process = spawn(GROUP)
    now = ProcessIdentity.local(process.pid)
    assert process_alive(now)
    assert process_alive(ProcessIdentity(process.pid, None))  # a state from before start times: trusted
    assert not process_alive(ProcessIdentity(process.pid, now.start_ticks + 100))
    assert not process_alive(None)


def test_a_zombie_and_a_free_pid_are_not_alive() -> None:
    process = subprocess.Popen(["true"])
    # Unreaped, it stays a zombie under its pid.
    wait_for(lambda: not pid_alive(process.pid), 10, "the child to exit")
    assert Path(f"/proc/{process.pid}/stat").exists()
    process.wait()
    assert not pid_alive(process.pid)
    assert not pid_alive(None) and not pid_alive(0)


def test_start_ticks_are_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    fields_after_name = " ".join(["S"] + [str(n) for n in range(4, 22)] + ["987654"] + ["0"] * 30)
    assert start_ticks_in(f"1234 (a b) c)) {fields_after_name}") == 987654


def test_poll_until_gives_up_at_the_timeout_after_a_last_look() -> None:
    looks: list[int] = []

    def never() -> bool:
        looks.append(1)
        return False

    assert not poll_until(never, timeout_s=0.3, interval_s=0.05)
    assert len(looks) >= 2  # the first look and the one at the deadline at least


def test_poll_until_returns_as_soon_as_the_condition_holds() -> None:
    looks: list[int] = []

    def third_look() -> bool:
        looks.append(1)
        return len(looks) == 3

    assert poll_until(third_look, timeout_s=30, interval_s=0.01)
    assert len(looks) == 3


def test_a_zero_timeout_still_looks_once() -> None:
    assert poll_until(lambda: True, timeout_s=0)


def test_free_ports_are_distinct_and_a_bound_one_is_not_free() -> None:
    ports = pick_free_ports(3)
    assert len(set(ports)) == 3 and all(port_free("127.0.0.1", port) for port in ports)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[0]))
        busy.listen()
        assert not port_free("127.0.0.1", ports[0])


def test_free_ports_are_never_ones_the_kernel_hands_to_outgoing_connections() -> None:
    low, high = (int(word) for word in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not [port for port in pick_free_ports(200) if low <= port <= high or port > 65000]


def test_the_tail_of_a_log_is_its_last_lines_and_a_missing_log_says_so(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {n}\n" for n in range(100)) + "Traceback: the error")
    assert tail_of_file(log, 2) == "line 99\nTraceback: the error"
    assert tail_of_file(tmp_path / "none.log", 5) == f"(no log at {tmp_path / 'none.log'})"


def test_a_group_is_alive_while_its_leader_or_a_member_left_by_it_runs(spawn) -> None:
    # The daemon's worker checks ask this of every worker every 2 s: a running leader answers at once,
    # a leader that died leaves the question to its group's members (a vLLM engine core left behind).
    groups = LocalProcessGroups()
    process = spawn(GROUP)
    assert groups.group_has_members(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()  # reaped: no zombie, only the background `sleep` is left in the group
    assert groups.group_has_members(process.pid)
    signal_group_kill(process.pid)
    wait_for(lambda: not groups.group_has_members(process.pid), 10, "the group to be empty")
