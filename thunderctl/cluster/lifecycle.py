"""Bringing a cluster up and down: workers, the daemon, and the state that lets `down` clean up."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from thunderctl.cluster.plan import WorkerPlan
from thunderctl.cluster.state import ClusterState, WorkerRecord, pid_alive
from thunderctl.engines.local import EngineStopError, spawn_detached, stop_process_group, tail_of_file
from thunderctl.profile import Profile, state_root

DAEMON_START_TIMEOUT_S = 30.0


class LaunchError(RuntimeError):
    """Something `up` started did not come up; what it started has been stopped."""


def control_client(state: ClusterState, timeout: float = 30.0) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=str(state.socket_path))
    return httpx.Client(transport=transport, base_url="http://thunderctl", timeout=timeout)


def daemon_answers(state: ClusterState) -> bool:
    if not state.socket_path.exists():
        return False
    try:
        with control_client(state, timeout=5) as client:
            return client.get("/status").status_code == 200
    except httpx.HTTPError:
        return False


def new_state(profile: Profile, profile_path: Path) -> ClusterState:
    gateway = profile.gateway
    return ClusterState(
        cluster=profile.cluster,
        dir=state_root(profile) / profile.cluster,
        profile_path=str(profile_path.resolve()),
        endpoint=f"http://{gateway.host}:{gateway.port}/v1",
    )


def start_workers(state: ClusterState, plans: list[WorkerPlan]) -> None:
    """Spawn every worker detached; each is recorded before the next starts, so a crash of
    `up` itself still leaves a state that `down` can clean up."""
    for plan in plans:
        log_path = state.worker_log(plan.id)
        process = spawn_detached(plan.command, {**os.environ, **plan.env}, log_path)
        state.workers.append(WorkerRecord(plan.id, plan.node, plan.url, process.pid, str(log_path)))
        state.save()


def wait_workers_healthy(
    state: ClusterState, timeout: float, on_progress: Callable[[int, int, float], None]
) -> None:
    started = time.monotonic()
    pending = {w.id: w for w in state.workers if not w.stopped}
    with httpx.Client(timeout=2.0) as client:
        while pending:
            elapsed = time.monotonic() - started
            for worker in list(pending.values()):
                if not pid_alive(worker.pid):
                    raise LaunchError(f"worker {worker.id} exited during start-up; log tail:\n"
                                      f"{tail_of_file(Path(worker.log_path), 30)}")
                try:
                    if client.get(f"{worker.url}/health").status_code == 200:
                        del pending[worker.id]
                except httpx.HTTPError:
                    pass
            on_progress(len(state.workers) - len(pending), len(state.workers), elapsed)
            if pending and elapsed > timeout:
                first = next(iter(pending.values()))
                raise LaunchError(f"worker {first.id} not healthy after {timeout:.0f} s; log tail:\n"
                                  f"{tail_of_file(Path(first.log_path), 30)}")
            if pending:
                time.sleep(0.5)


def start_daemon(state: ClusterState) -> None:
    process = spawn_detached([sys.executable, "-m", "thunderctl.daemon", str(state.dir)], dict(os.environ), state.daemon_log)
    state.daemon_pid = process.pid
    state.save()
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while not daemon_answers(state):
        if process.poll() is not None or time.monotonic() > deadline:
            raise LaunchError(f"the daemon did not start; log tail:\n{tail_of_file(state.daemon_log, 30)}")
        time.sleep(0.2)


@dataclass(frozen=True)
class StopReport:
    worker_id: str
    outcome: str  # "stopped", "already stopped", or what went wrong


def stop_workers(state: ClusterState) -> list[StopReport]:
    reports = []
    for worker in state.workers:
        if worker.stopped and not pid_alive(worker.pid):
            reports.append(StopReport(worker.id, "already stopped"))
            continue
        try:
            stop_process_group(worker.pid)
            outcome = "stopped"
        except EngineStopError as exc:
            outcome = str(exc)
        worker.stopped = outcome == "stopped"
        reports.append(StopReport(worker.id, outcome))
    state.save()
    return reports


def stop_daemon(state: ClusterState, drain_timeout: float) -> dict | None:
    """Ask the daemon to drain and exit; kill it if it does not. Returns its shutdown report."""
    report = None
    if daemon_answers(state):
        try:
            with control_client(state, timeout=drain_timeout + 30) as client:
                report = client.post("/shutdown", json={"timeout": drain_timeout}).json()
        except httpx.HTTPError:
            report = None
    if state.daemon_pid and pid_alive(state.daemon_pid):
        try:
            stop_process_group(state.daemon_pid, timeout=10)
        except EngineStopError:
            pass
    state.socket_path.unlink(missing_ok=True)
    return report


def tear_down(state: ClusterState, drain_timeout: float) -> tuple[dict | None, list[StopReport]]:
    """Daemon first (it drains and releases), then the workers, then the state itself."""
    report = stop_daemon(state, drain_timeout)
    stops = stop_workers(state)
    if all(s.outcome in ("stopped", "already stopped") for s in stops):
        shutil.rmtree(state.dir, ignore_errors=True)
    return report, stops


def existing_state(profile: Profile) -> ClusterState | None:
    directory = state_root(profile) / profile.cluster
    return ClusterState.load(directory) if (directory / "state.json").is_file() else None


def any_worker_alive(state: ClusterState) -> bool:
    return any(pid_alive(w.pid) for w in state.workers if not w.stopped)


def recover(state: ClusterState, plans: list[WorkerPlan], timeout: float,
            on_progress: Callable[[int, int, float], None]) -> list[str]:
    """A cluster whose daemon died: restart the workers that died with it (not those a drain
    stopped on purpose), then a new daemon. Returns the ids of the workers restarted."""
    by_id = {plan.id: plan for plan in plans}
    revived = []
    for worker in state.workers:
        if worker.stopped or pid_alive(worker.pid) or worker.id not in by_id:
            continue
        plan = by_id[worker.id]
        worker.pid = spawn_detached(plan.command, {**os.environ, **plan.env}, Path(worker.log_path)).pid
        revived.append(worker.id)
    state.save()
    wait_workers_healthy(state, timeout, on_progress)
    start_daemon(state)
    return revived


def launch(
    profile: Profile,
    profile_path: Path,
    plans: list[WorkerPlan],
    timeout: float,
    on_progress: Callable[[int, int, float], None],
) -> ClusterState:
    """Start workers, wait for their health, start the daemon; on any failure stop all of it."""
    state = new_state(profile, profile_path)
    state.save()
    try:
        start_workers(state, plans)
        wait_workers_healthy(state, timeout, on_progress)
        start_daemon(state)
    except BaseException:
        tear_down(state, drain_timeout=0)
        raise
    return state
