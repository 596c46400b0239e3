"""Which process a pid names: its start time tells a recorded process from one that got its pid."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ProcessIdentity:
    """A pid and when its process started, in clock ticks after its node booted (field 22 of
    /proc/PID/stat, read on the node itself): once a process is gone its pid may be handed to
    another, and only the start time tells the two apart."""

    pid: int
    start_ticks: int | None = None  # None: recorded by a thunderctl that did not keep it; trusted

    @classmethod
    def local(cls, pid: int) -> ProcessIdentity:
        """The process holding `pid` on this machine now."""
        return cls(pid, local_start_ticks(pid))

    def reused(self, start_ticks_now: int | None) -> bool:
        """Whether the pid now belongs to another process, given the start ticks of whatever holds
        it now (None: nothing does, so there is no stranger to spare)."""
        return None not in (self.start_ticks, start_ticks_now) and start_ticks_now != self.start_ticks


def local_start_ticks(pid: int) -> int | None:
    """When the process holding `pid` on this machine started, or None if none does.

    Read from /proc rather than psutil's create_time: the ticks are what an SSH node's
    /proc gives and what the cluster state records, so all are compared on one clock.
    """
    try:
        return start_ticks_in(Path(f"/proc/{pid}/stat").read_text())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def start_ticks_in(stat_line: str) -> int:
    """Field 22 of a /proc/PID/stat line: the start time in clock ticks after boot."""
    # The command name is in parentheses and may itself contain spaces or ')'.
    return int(stat_line[stat_line.rindex(")") + 2 :].split()[19])


def pid_alive(pid: int | None) -> bool:
    """Whether a process holds `pid` on this machine and runs (a zombie does not)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def process_alive(process: ProcessIdentity | None) -> bool:
    """Whether the recorded process of this machine still runs: its pid, not reused by another."""
    return process is not None and pid_alive(process.pid) and not process.reused(local_start_ticks(process.pid))
