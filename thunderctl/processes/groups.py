"""Process groups: start a command as the leader of its own, and stop the whole group.

A server's children (vLLM's engine core and workers) share its group and outlive a SIGKILL
of the server alone, so a stop signals and accounts for the group. How a group is stopped is
written once (GroupStop); where it lives, this machine or a node over SSH, is a ProcessGroups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from thunderctl.processes.identity import ProcessIdentity, local_start_ticks
from thunderctl.processes.poll import poll_until


class StopError(RuntimeError):
    """Something stopped is still there: processes of a group after SIGKILL (or, for a cluster
    worker, its container after `docker rm -f`)."""


class ProcessGroups(Protocol):
    """The process groups of one machine, as a stop needs to see them."""

    description: str
    # How often a stop looks at the group again: cheap here, an SSH round trip on a node.
    poll_s: float

    def start_ticks(self, pid: int) -> int | None:
        """When the process holding `pid` now started (ProcessIdentity's clock), or None."""

    def signal_group(self, pgid: int, sig: signal.Signals) -> bool:
        """Send `sig` to every process of the group; False when there is no such group."""

    def group_members(self, pgid: int) -> list[int]:
        """The live processes of a group (zombies do not count), whoever started it."""


@dataclass(frozen=True)
class GroupStop:
    """SIGTERM, `term_wait_s` for the group to end, SIGKILL, `kill_wait_s` more; what is left
    after that is a StopError."""

    term_wait_s: float = 15.0
    kill_wait_s: float = 5.0

    def stop(self, pgid: int, groups: ProcessGroups) -> None:
        if not groups.signal_group(pgid, signal.SIGTERM):
            return  # no such group: it had already ended
        if self._wait_empty(pgid, groups, self.term_wait_s):
            return
        groups.signal_group(pgid, signal.SIGKILL)
        if self._wait_empty(pgid, groups, self.kill_wait_s):
            return
        raise StopError(
            f"processes {groups.group_members(pgid)} of group {pgid} on {groups.description} survived SIGKILL"
        )

    def stop_recorded(self, leader: ProcessIdentity, groups: ProcessGroups) -> bool:
        """Stop the leader's group, unless its pid now belongs to another process (ours had ended
        long before): then nothing is signalled and the answer is False."""
        if leader.reused(groups.start_ticks(leader.pid)):
            return False
        self.stop(leader.pid, groups)
        return True

    @staticmethod
    def _wait_empty(pgid: int, groups: ProcessGroups, timeout_s: float) -> bool:
        return poll_until(lambda: not groups.group_members(pgid), timeout_s, groups.poll_s)


class LocalProcessGroups:
    """The process groups of this machine, through the kernel directly."""

    description = "this machine"
    poll_s = 0.1

    def start_ticks(self, pid: int) -> int | None:
        return local_start_ticks(pid)

    def signal_group(self, pgid: int, sig: signal.Signals) -> bool:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        return True

    def group_has_members(self, pgid: int) -> bool:
        # Its leader running is the common answer, read from the leader's own /proc entry. A scan of
        # every process on the machine, for each of 8 workers every 2 s (the daemon's worker checks),
        # was 44 % of a loaded daemon's py-spy samples, its thread holding the GIL from the event loop.
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if psutil.Process(pgid).status() != psutil.STATUS_ZOMBIE and os.getpgid(pgid) == pgid:
                return True
        return bool(self.group_members(pgid))

    def group_members(self, pgid: int) -> list[int]:
        members = []
        for process in psutil.process_iter(["status"]):
            # A zombie holds no memory; it only waits for its parent (maybe us) to reap it.
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if os.getpgid(process.pid) == pgid:
                    members.append(process.pid)
            except ProcessLookupError:
                continue  # ended while we looked
        return members


def stop_recorded_group(leader: ProcessIdentity, timeout: float = 15) -> bool:
    """GroupStop.stop_recorded of a group on this machine, with `timeout` for SIGTERM."""
    return GroupStop(term_wait_s=timeout).stop_recorded(leader, LocalProcessGroups())


def spawn_detached(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a server in its own session, output appended to log_path.

    Its own session makes it a process-group leader: the children it starts share that
    group, so a stop can signal and account for all of them at once.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
