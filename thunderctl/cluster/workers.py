"""Workers on their nodes: install the engine, start, wait for health, stop, start again, follow
their logs. A node is this machine or an SSH host; both go through a Transport, and nodes are
handled in parallel (one thread each)."""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import httpx

from thunderctl.cluster.gpus import GpuQueryError, wait_released
from thunderctl.cluster.install import INSTALL_TIMEOUT_S, NODE_STATE_ROOT, InstallStep, node_cluster_dir
from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.plan import WorkerPlan
from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.cluster.transport import Transport, TransportError, in_parallel
from thunderctl.cluster.tunnel import tunnel_command
from thunderctl.cluster.worker_key import read_worker_key
from thunderctl.engines.local import probe_health
from thunderctl.jsonapi import bearer_headers
from thunderctl.processes import (
    ProcessIdentity,
    StopError,
    pick_free_port,
    process_alive,
    spawn_detached,
    stop_recorded_group,
    tail_of_file,
)
from thunderctl.processes.poll import poll_until

WORKER_STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 30
HEALTH_POLL_S = 0.5
PORT_FREED_TIMEOUT_S = 30.0  # past it the worker starts anyway, and its log says why it did not bind
FOLLOW_POLL_S = 0.5

Report = Callable[[str], None]
T = TypeVar("T")


class LaunchError(RuntimeError):
    """Something `up` started did not come up; the message says what of it could be stopped."""


def by_node(workers: list[T], node_of: Callable[[T], str]) -> list[list[T]]:
    groups: dict[str, list[T]] = {}
    for worker in workers:
        groups.setdefault(node_of(worker), []).append(worker)
    return list(groups.values())


def install_engines(
    state: ClusterState, plans: list[WorkerPlan], step: InstallStep, transports: Transports, report: Report
) -> None:
    """Run the install step on every node that still needs it, all nodes at once."""
    log = f"{node_cluster_dir(state.cluster)}/install.log"

    def install(node_plans: list[WorkerPlan]) -> None:
        transport = transports.to(node_plans[0].ssh)
        if transport.run(step.done_check).ok:
            return
        report(f"{node_plans[0].node}: installing {step.what} (log {transport.description}:~/{log})")
        command = f"mkdir -p {node_cluster_dir(state.cluster)} && {{ {step.command} ; }} >> {log} 2>&1"
        if not transport.run(command, timeout=INSTALL_TIMEOUT_S).ok:
            raise LaunchError(
                f"installing {step.what} on node {node_plans[0].node} failed; log tail:\n"
                f"{transport.tail(log, LOG_TAIL_LINES)}"
            )

    in_parallel(install, by_node(plans, lambda p: p.node))


def worker_log(state: ClusterState, plan: WorkerPlan) -> str:
    """In the state directory on this machine; under the node's own state root on an SSH node."""
    local = state.worker_log(plan.id)
    return str(local) if plan.ssh is None else f"{node_cluster_dir(state.cluster)}/logs/{local.name}"


def open_tunnel(state: ClusterState, worker: WorkerRecord, remote_port: int, local_port: int) -> None:
    assert worker.ssh is not None, "a tunnel leads to an SSH node"
    command = tunnel_command(worker.ssh, local_port, remote_port)
    tunnel = ProcessIdentity.local(spawn_detached(command, dict(os.environ), state.tunnel_log(worker.id)).pid)
    worker.tunnel_pid, worker.tunnel_start_ticks = tunnel.pid, tunnel.start_ticks
    worker.url = f"http://127.0.0.1:{local_port}"


def start_workers(state: ClusterState, plans: list[WorkerPlan], transports: Transports, worker_key: str) -> None:
    """Spawn every worker detached, nodes in parallel; each is recorded as soon as it runs, so a
    crash of `up` itself still leaves a state that `down` can clean up."""
    lock = threading.Lock()

    def save(new: WorkerRecord | None = None) -> None:
        with lock:
            if new is not None:
                state.workers.append(new)
            state.save()

    def start_node(node_plans: list[WorkerPlan]) -> None:
        transport = transports.to(node_plans[0].ssh)
        for plan in node_plans:
            log_path = worker_log(state, plan)
            process = transport.start_detached(plan.command, plan.launch_env(worker_key), log_path)
            worker = WorkerRecord(
                plan.id,
                plan.node,
                plan.url,
                process.pid,
                log_path,
                ssh=plan.ssh,
                gpus=list(plan.gpus),
                container=plan.container,
                start_ticks=process.start_ticks,
            )
            save(worker)
            if plan.tunnel:
                open_tunnel(state, worker, plan.port, pick_free_port())
                save()

    in_parallel(start_node, by_node(plans, lambda p: p.node))
    order = {plan.id: i for i, plan in enumerate(plans)}
    state.workers.sort(key=lambda w: order[w.id])
    state.save()


def start_failure(worker: WorkerRecord, state: ClusterState, transport: Transport) -> str | None:
    """Why a starting worker can no longer come up, with the log that says so; None while it may."""
    if not transport.group_alive(worker.process):
        return (
            f"worker {worker.id} exited during start-up on {transport.description}; log tail:\n"
            f"{transport.tail(worker.log_path, LOG_TAIL_LINES)}"
        )
    if worker.tunnel is not None and not process_alive(worker.tunnel):
        return (
            f"the SSH tunnel to worker {worker.id} ended; its log:\n"
            f"{tail_of_file(state.tunnel_log(worker.id), LOG_TAIL_LINES)}"
        )
    return None


def wait_workers_healthy(state: ClusterState, timeout: float, report: Report, transports: Transports) -> None:
    started = time.monotonic()
    pending = {w.id: w for w in state.workers if not w.stopped}
    with httpx.Client(timeout=2.0, headers=bearer_headers(read_worker_key(state.dir))) as client:
        while pending:
            elapsed = time.monotonic() - started
            for worker in list(pending.values()):
                transport = transports.to(worker.ssh)
                failure = start_failure(worker, state, transport)
                if failure:
                    raise LaunchError(failure)
                if probe_health(client, worker.url):
                    del pending[worker.id]
            report(f"workers healthy: {len(state.workers) - len(pending)}/{len(state.workers)} ({elapsed:.0f} s)")
            if pending and elapsed > timeout:
                first = next(iter(pending.values()))
                raise LaunchError(
                    f"worker {first.id} not healthy after {timeout:.0f} s; log tail:\n"
                    f"{transports.to(first.ssh).tail(first.log_path, LOG_TAIL_LINES)}"
                )
            if pending:
                time.sleep(HEALTH_POLL_S)


@dataclass(frozen=True)
class StopReport:
    worker_id: str
    node: str
    ok: bool  # nothing of it is left running
    outcome: str  # "stopped", "already stopped", or what went wrong


def stop_worker(worker: WorkerRecord, transports: Transports) -> StopReport:
    """Stop a worker's process group on its node, its container and tunnel, and check that its
    GPUs were given back (a child that escaped the group would still hold them). A pid that now
    belongs to another process is not signalled: the worker had ended long before."""
    transport = transports.to(worker.ssh)
    try:
        if worker.stopped and not transport.group_alive(worker.process):
            return StopReport(worker.id, worker.node, True, "already stopped")
        signalled = transport.stop_group(worker.process, WORKER_STOP_TIMEOUT_S)
        if worker.container:
            remove_container(transport, worker.container)
        tunnel_spared = worker.tunnel is not None and not stop_recorded_group(worker.tunnel)
        held = wait_released(transport, worker.gpus) if worker.gpus and signalled else []
    except (StopError, TransportError, GpuQueryError) as error:
        return StopReport(worker.id, worker.node, False, str(error))
    if held:
        memory = "; ".join(gpu.memory_text() for gpu in held)
        return StopReport(
            worker.id,
            worker.node,
            False,
            f"stopped, but its GPUs are still in use ({memory}): see nvidia-smi on the node",
        )
    if not signalled:
        outcome = f"already stopped (pid {worker.pid} now belongs to another process)"
    else:
        outcome = "stopped; GPU memory freed" if worker.gpus else "stopped"
    if tunnel_spared:
        outcome += f"; its tunnel had ended (pid {worker.tunnel_pid} now belongs to another process)"
    return StopReport(worker.id, worker.node, True, outcome)


def remove_container(transport: Transport, name: str) -> None:
    """`docker run --rm` removes its container when it stops on a signal; a SIGKILLed docker
    client leaves it running, so remove it by name and check it is gone."""
    quoted = shlex.quote(name)
    left = transport.run(f"docker rm -f {quoted} > /dev/null 2>&1; docker ps -aq --filter name=^{quoted}$").stdout
    if left.strip():
        raise StopError(f"container {name} is still there: docker rm -f {name}")


def stop_workers(state: ClusterState, transports: Transports) -> list[StopReport]:
    """Every worker, nodes in parallel; then, on SSH nodes left with nothing, their state directory."""
    reports = [
        r
        for node in in_parallel(
            lambda ws: [stop_worker(w, transports) for w in ws], by_node(state.workers, lambda w: w.node)
        )
        for r in node
    ]
    outcome = {report.worker_id: report for report in reports}
    for worker in state.workers:
        worker.stopped = outcome[worker.id].ok
    state.save()
    for node in by_node(state.workers, lambda w: w.node):
        if node[0].ssh is not None and all(outcome[w.id].ok for w in node):
            remove_node_dir(transports.to(node[0].ssh), state.cluster)
    return [outcome[w.id] for w in state.workers]


def remove_node_dir(transport: Transport, cluster: str) -> None:
    # rmdir leaves the root if another cluster still uses it.
    transport.run(f"rm -rf {shlex.quote(node_cluster_dir(cluster))}; rmdir {NODE_STATE_ROOT} 2> /dev/null; true")


def any_worker_alive(state: ClusterState, transports: Transports) -> bool:
    return any(transports.to(w.ssh).group_alive(w.process) for w in state.workers if not w.stopped)


def revive_worker(
    state: ClusterState, worker: WorkerRecord, plan: WorkerPlan, transport: Transport, worker_key: str | None
) -> bool:
    """Start a worker again if its process group is gone (and its tunnel, if that ended), as its
    plan says, logging to the same file. Returns whether the worker itself was restarted."""
    restarted = False
    if not transport.group_alive(worker.process):
        if worker.container:
            remove_container(transport, worker.container)  # a killed `docker run` can leave it behind
        # A killed worker's port frees only once the last process holding it has gone, which may be a
        # moment after its group looks dead: started before, the new worker fails to bind.
        poll_until(lambda: not transport.busy_ports(plan.host, [plan.port]), PORT_FREED_TIMEOUT_S, HEALTH_POLL_S)
        process = transport.start_detached(plan.command, plan.launch_env(worker_key), worker.log_path)
        worker.pid, worker.start_ticks = process.pid, process.start_ticks
        restarted = True
    if worker.tunnel is not None and not process_alive(worker.tunnel):
        # The same local end, so the URL the daemon knows stays right.
        open_tunnel(state, worker, plan.port, httpx.URL(worker.url).port or pick_free_port())
    return restarted


def revive_dead_workers(
    state: ClusterState, plans: list[WorkerPlan], transports: Transports, worker_key: str | None
) -> list[str]:
    """Every worker that died without being stopped on purpose, started again. Returns their ids."""
    by_id = {plan.id: plan for plan in plans}
    return [
        worker.id for worker in state.workers
        if not worker.stopped and worker.id in by_id
        and revive_worker(state, worker, by_id[worker.id], transports.to(worker.ssh), worker_key)
    ]  # fmt: skip


def follow_lines(transport: Transport, path: str, start: int) -> Iterator[str]:
    """New complete lines of a file from line `start` on, polled (each read has its timeout, and
    nothing is left running on the node when the reader stops)."""
    while True:
        lines = transport.lines_from(path, start)
        start += len(lines)
        yield from lines
        if not lines:
            time.sleep(FOLLOW_POLL_S)
