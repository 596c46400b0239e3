"""Bringing a cluster up and down: its workers (cluster/workers.py), then the daemon that serves
them under its supervisor (daemon/supervisor.py), and the state that lets `down` clean up after a
crash. This sits above the daemon it starts and asks to shut down."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from thunderctl.cluster.install import install_step
from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.plan import WorkerPlan
from thunderctl.cluster.state import ClusterState, DaemonRecord
from thunderctl.cluster.transport import TransportError
from thunderctl.cluster.worker_key import create_worker_key, read_worker_key
from thunderctl.cluster.workers import (
    HEALTH_POLL_S,
    LOG_TAIL_LINES,
    LaunchError,
    Report,
    StopReport,
    install_engines,
    revive_dead_workers,
    start_workers,
    stop_workers,
    wait_workers_healthy,
)
from thunderctl.daemon.client import control_client, daemon_answers, fetch_status
from thunderctl.daemon.service import collect_orphaned_sandboxes
from thunderctl.gateway.links import WorkerState
from thunderctl.processes import (
    ProcessIdentity,
    StopError,
    poll_until,
    process_alive,
    spawn_detached,
    stop_recorded_group,
    tail_of_file,
)
from thunderctl.profile import GatewaySpec, Profile, state_root
from thunderctl.sandbox import Sweep

# A daemon that dies is seen at once (its supervisor records its end); this bounds only one that
# neither dies nor answers. On a 2-core machine at a load average of 35, its imports alone took over 30 s.
DAEMON_START_TIMEOUT_S = 120.0
DAEMON_EXIT_TIMEOUT_S = 60.0
# A worker that answers /health rejoins at the daemon's next metrics poll (seconds apart).
REJOIN_TIMEOUT_S = 30.0


def new_state(profile: Profile, profile_path: Path) -> ClusterState:
    gateway = profile.gateway
    return ClusterState(
        cluster=profile.cluster,
        dir=state_root(profile) / profile.cluster,
        profile_path=str(profile_path.resolve()),
        endpoint=f"http://{gateway.host}:{gateway.port}/v1",
    )


def start_supervisor(state: ClusterState, gateway: GatewaySpec) -> None:
    """Start the daemon's supervisor (daemon/supervisor.py) on the gateway's address, and wait for its
    daemon to answer."""
    since = time.time()
    state.daemon_record_file.unlink(missing_ok=True)  # a dead supervisor's: this one keeps its own
    command = [sys.executable, "-m", "thunderctl.daemon.supervisor", str(state.dir), gateway.host, str(gateway.port)]
    relays = ["--relays", str(gateway.relay_processes())]
    process = spawn_detached([*command, str(gateway.backlog), *relays], dict(os.environ), state.daemon_log)
    supervisor = ProcessIdentity.local(process.pid)
    state.supervisor_pid, state.supervisor_start_ticks = supervisor.pid, supervisor.start_ticks
    state.save()
    wait_daemon_answers(state, since)


def supervisor_running(state: ClusterState) -> bool:
    """Whether the cluster's supervisor runs: then the cluster does, its daemon started again when it dies."""
    return process_alive(state.supervisor_process)


def wait_daemon_answers(state: ClusterState, since: float) -> None:
    """Until the daemon answers on its control socket. A LaunchError saying why, with the end of its
    log, once it has ended at `since` or later, waits out a backoff, has no supervisor, or does not
    answer within DAEMON_START_TIMEOUT_S."""

    def settled() -> bool:
        record = DaemonRecord.load(state.daemon_record_file)
        ended = record.last_exit_at is not None and record.last_exit_at >= since
        return daemon_answers(state) or ended or backoff_left_s(record) > 0 or not supervisor_running(state)

    if not poll_until(settled, DAEMON_START_TIMEOUT_S, 0.2) or not daemon_answers(state):
        raise LaunchError(daemon_trouble(state))


def backoff_left_s(record: DaemonRecord) -> float:
    """How long the supervisor still waits before it starts the daemon again (0: it is not waiting)."""
    return max(0.0, (record.next_start_at or 0.0) - time.time())


def daemon_trouble(state: ClusterState) -> str:
    """Why the daemon does not answer, from what its supervisor recorded, and the end of its log."""
    record = DaemonRecord.load(state.daemon_record_file)
    if not supervisor_running(state):
        why = "its supervisor has exited"
    elif record.last_exit is None:
        why = f"it has not answered yet (pid {record.pid})"
    else:
        why = f"it ended ({record.last_exit})"
        if record.restarts:
            why += f" after {record.restarts} restart(s)"
        if backoff_left_s(record) > 0:
            why += f"; it keeps dying, and its supervisor starts it again in {backoff_left_s(record):.0f} s"
    tail = tail_of_file(state.daemon_log, LOG_TAIL_LINES)
    return f"the daemon of {state.cluster} does not answer: {why}; the end of its log, {state.daemon_log}:\n{tail}"


def stop_daemon(state: ClusterState, drain_timeout: float) -> tuple[dict | None, str | None]:
    """Ask the daemon to drain and exit, which ends its supervisor too; stop the supervisor's group (it
    and the daemon it runs) if that does not. Returns the daemon's shutdown report, and what of the
    group did not stop, if anything."""
    report, left = None, None
    if daemon_answers(state):
        try:
            with control_client(state, timeout=drain_timeout + 30) as client:
                report = client.post("/shutdown", json={"timeout": drain_timeout}).json()
        except httpx.HTTPError:
            report = None
    # An acknowledged shutdown ends with the sandbox pool removing its containers: let it finish.
    if report is not None:
        poll_until(lambda: not supervisor_running(state), DAEMON_EXIT_TIMEOUT_S, HEALTH_POLL_S)
    # Even with the supervisor dead, a daemon it ran may be left in its group.
    if state.supervisor_process is not None:
        try:
            stop_recorded_group(state.supervisor_process, timeout=10)
        except StopError as exc:
            left = f"the daemon or its supervisor did not stop ({exc}); its log: {state.daemon_log}"
    state.socket_path.unlink(missing_ok=True)
    return report, left


@dataclass(frozen=True)
class Teardown:
    """What `down` (or a failed `up` undoing itself) did, and what it could not remove."""

    report: dict | None  # the daemon's own shutdown report; None when it did not answer
    daemon_left: str | None  # why the daemon is still there, if it is
    sandboxes: Sweep
    stops: list[StopReport]

    @property
    def left(self) -> list[str]:
        """Everything still there, each naming where and why."""
        workers = [f"{s.worker_id}: {s.outcome}" for s in self.stops if not s.ok]
        return [*([self.daemon_left] if self.daemon_left else []), *workers, *self.sandboxes.left]

    def note(self, state: ClusterState) -> str:
        """What is left and how to finish, for a teardown that is not complete."""
        return (
            f"not everything could be removed; the state is kept in {state.dir}, the only record of these:\n"
            + "\n".join(f"  {line}" for line in self.left)
            + "\n`thunderctl down` again, once Docker answers (and the processes named can be stopped), finishes it"
        )


def tear_down(state: ClusterState, drain_timeout: float, transports: Transports) -> Teardown:
    """Daemon first (it drains and releases), then what its sandbox pool left, then the workers;
    then the state itself, unless something of the cluster is left: it is the record of where."""
    report, daemon_left = stop_daemon(state, drain_timeout)
    sandboxes = Sweep(0, [])
    if daemon_left is None:  # a daemon left may still be making containers: no sweep under it
        sandboxes = asyncio.run(collect_orphaned_sandboxes(state))
    teardown = Teardown(report, daemon_left, sandboxes, stop_workers(state, transports))
    if not teardown.left:
        shutil.rmtree(state.dir, ignore_errors=True)
    return teardown


def existing_state(profile: Profile) -> ClusterState | None:
    directory = state_root(profile) / profile.cluster
    return ClusterState.load(directory) if (directory / "state.json").is_file() else None


def recover(
    state: ClusterState,
    gateway: GatewaySpec,
    plans: list[WorkerPlan],
    timeout: float,
    report: Report,
    transports: Transports,
) -> list[str]:
    """A cluster whose supervisor died: stop a daemon it left, restart the workers that died (not those
    a drain stopped on purpose) and their tunnels, then a new supervisor. Returns the ids of the
    workers restarted."""
    _, daemon_left = stop_daemon(state, drain_timeout=0)
    if daemon_left is not None:
        raise LaunchError(daemon_left)
    worker_key = read_worker_key(state.dir) or create_worker_key(state.dir)
    revived = revive_dead_workers(state, plans, transports, worker_key)
    state.save()
    wait_workers_healthy(state, timeout, report, transports)
    start_supervisor(state, gateway)
    return revived


@dataclass(frozen=True)
class Reconciliation:
    """What `up` did to a running cluster, and what of the profile it cannot apply in place."""

    restarted: list[str]
    not_running: list[str]  # in the profile, not in the cluster
    not_in_profile: list[str]

    def summary(self) -> str:
        done = (
            f"restarted {', '.join(self.restarted)} (its process had exited)" if self.restarted else "nothing changed"
        )
        differs = [f"the profile's {', '.join(self.not_running)} not running"] if self.not_running else []
        differs += [f"{', '.join(self.not_in_profile)} not in the profile"] if self.not_in_profile else []
        if differs:
            done += f"; {' and '.join(differs)}: `thunderctl down`, then `up`, to apply the profile"
        return done


def reconcile(
    state: ClusterState, plans: list[WorkerPlan], timeout: float, report: Report, transports: Transports
) -> Reconciliation:
    """A running cluster: once its daemon answers (it may be starting again), it starts again, now,
    every worker that died (not those a drain stopped), and `up` waits for them to be healthy."""
    wait_daemon_answers(state, since=time.time())
    with control_client(state) as client:
        restarted = client.post("/workers/revive").raise_for_status().json()["restarted"]
    if restarted:
        wait_workers_healthy(ClusterState.load(state.dir), timeout, report, transports)
        wait_back_in_service(state, restarted)
    planned, running = [p.id for p in plans], [w.id for w in state.workers]
    return Reconciliation(restarted, [i for i in planned if i not in running], [i for i in running if i not in planned])


def wait_back_in_service(state: ClusterState, worker_ids: list[str]) -> None:
    """Until the daemon serves from the workers again (its next poll of their metrics), so that
    `status` right after `up` shows them ready."""

    def back() -> bool:
        states = {w.id: w.state for w in fetch_status(state).workers}
        return all(states.get(worker_id) == WorkerState.READY for worker_id in worker_ids)

    if not poll_until(back, REJOIN_TIMEOUT_S, HEALTH_POLL_S):
        raise LaunchError(
            f"{', '.join(worker_ids)} answer their health check, but the daemon has not taken them back after "
            f"{REJOIN_TIMEOUT_S:.0f} s; `thunderctl logs daemon` says why"
        )


def launch(
    profile: Profile,
    profile_path: Path,
    plans: list[WorkerPlan],
    timeout: float,
    report: Report,
    transports: Transports,
) -> ClusterState:
    """Install where needed, start workers, wait for their health, start the daemon; on any
    failure stop all of it, and say whether that worked."""
    state = new_state(profile, profile_path)
    state.save()
    worker_key = create_worker_key(state.dir)
    try:
        step = install_step(profile.engine)
        if step is not None:
            install_engines(state, plans, step, transports, report)
        start_workers(state, plans, transports, worker_key)
        wait_workers_healthy(state, timeout, report, transports)
        start_supervisor(state, profile.gateway)
    except BaseException as error:
        teardown = tear_down(state, drain_timeout=0, transports=transports)
        if not isinstance(error, LaunchError | TransportError):
            raise
        note = teardown.note(state) if teardown.left else "everything this `up` started has been stopped"
        raise LaunchError(f"{error}\n{note}") from error
    return state
