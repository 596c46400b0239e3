"""Processes the controller starts and stops: their identity, groups, ports, logs and restart backoff."""

from thunderctl.processes.backoff import backoff_s
from thunderctl.processes.groups import (
    GroupStop,
    LocalProcessGroups,
    ProcessGroups,
    StopError,
    spawn_detached,
    stop_recorded_group,
)
from thunderctl.processes.identity import (
    ProcessIdentity,
    local_start_ticks,
    pid_alive,
    process_alive,
    start_ticks_in,
)
from thunderctl.processes.logs import tail_of_file
from thunderctl.processes.poll import poll_until
from thunderctl.processes.ports import listening_socket, pick_free_port, pick_free_ports, port_free

__all__ = [
    "backoff_s",
    "GroupStop",
    "LocalProcessGroups",
    "ProcessGroups",
    "ProcessIdentity",
    "StopError",
    "listening_socket",
    "local_start_ticks",
    "pick_free_port",
    "pick_free_ports",
    "pid_alive",
    "port_free",
    "poll_until",
    "process_alive",
    "spawn_detached",
    "start_ticks_in",
    "stop_recorded_group",
    "tail_of_file",
]
