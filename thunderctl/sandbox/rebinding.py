"""Binding again, in a daemon started after another died, the sandboxes of the programs it restored:
the state file's records of ready sandboxes, each checked against its Docker host."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from thunderctl.sandbox.calls import HostCalls
from thunderctl.sandbox.docker_host import DOCKER_ERRORS
from thunderctl.sandbox.host import SandboxHost
from thunderctl.sandbox.lease import Sandbox, SandboxState
from thunderctl.sandbox.state import BoundContainer

log = logging.getLogger(__name__)


def record_of(sandbox: Sandbox) -> BoundContainer:
    """What the state file keeps of a ready sandbox bound to a program."""
    if sandbox.container_id is None or sandbox.program_id is None:
        raise ValueError(f"sandbox {sandbox.id} is not bound to a container and a program")
    return BoundContainer(
        host=sandbox.host.url,
        container_id=sandbox.container_id,
        lease=sandbox.id,
        program_id=sandbox.program_id,
        image=sandbox.image,
        env=sandbox.env,
    )


async def rebind(
    records: list[BoundContainer],
    adopted: bool,
    live_programs: Collection[str],
    hosts: Mapping[str, SandboxHost],
    calls: HostCalls,
    now: float,
) -> list[Sandbox]:
    """The sandboxes of the records whose program lives on, ready again with their lease id, on a
    host of the pool, and whose container is still there. A host that does not answer now cannot
    say: its sandboxes are bound all the same (an exec there fails as it would have before)."""
    sandboxes = []
    for record in records:
        host, lease = hosts.get(record.host), record.lease
        if lease is None or record.program_id not in live_programs or host is None:
            continue
        if host.available:
            try:
                if await calls.run(host.inspect, record.container_id) is None:
                    log.info("sandbox %s of program %s: its container is gone", record.lease, record.program_id)
                    continue
            except DOCKER_ERRORS as exc:
                log.warning("checking container %s on %s: %s", record.container_id, host.url, exc)
        sandboxes.append(_sandbox(lease, record, adopted, host, now))
    return sandboxes


def _sandbox(lease: str, record: BoundContainer, adopted: bool, host: SandboxHost, now: float) -> Sandbox:
    sandbox = Sandbox(
        id=lease,
        image=record.image,
        host=host,
        requested_at=now,
        last_used=now,  # idle from the restart on: the outage is not the program's
        program_id=record.program_id,
        env=record.env,
        state=SandboxState.READY,
        container_id=record.container_id,
        adopted=adopted,
    )
    sandbox.settled.set()
    return sandbox
