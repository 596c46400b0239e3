"""A program's sandboxes survive the daemon's death, through the real CLI on a cluster of one
simulated worker with real Docker sandboxes: the daemon is killed (SIGKILL) with a live program
holding a sandbox the pool made and a container its agent started and adopted; once the supervisor
has started it again, both are there and serve the program's next exec, and its release removes
them. The sandboxes of a program released before the kill, and of one the scheduler never heard
of, do not outlive it.

One cluster and one kill serve the module, its tests in the order of a cluster's life.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import docker
import httpx
import pytest

from support import container_exists, run_by_hand, up_with_sandboxes, wait_for

pytestmark = pytest.mark.docker


@dataclass
class Restarted:
    """The cluster after the kill, and what its programs held before it."""

    gateway: str
    made: str  # the live program's sandbox, made by the pool (its id)
    adopted: str  # the live program's sandbox of the container its agent started
    released: str  # the sandbox of a program released before the kill
    unknown: str  # the sandbox of a program that never sent the gateway a request
    containers: dict[str, str]  # sandbox id -> its container


def chat(gateway: str, model: str, program_id: str) -> None:
    body = {"model": model, "program_id": program_id, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60).raise_for_status()


def ready_sandbox(gateway: str, program_id: str, **options: object) -> dict:
    made = httpx.post(f"{gateway}/v1/sandboxes", json={"program_id": program_id, **options}, timeout=60)
    made.raise_for_status()
    sandbox = httpx.get(f"{gateway}/v1/sandboxes/{made.json()['id']}", params={"wait": "ready"}, timeout=60).json()
    assert sandbox["state"] == "ready", sandbox
    return sandbox


def exec_in(gateway: str, sandbox_id: str, cmd: str) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, "timeout": 10}, timeout=30)


@pytest.fixture(scope="module")
def restarted(
    tmp_path_factory: pytest.TempPathFactory, module_sandbox_image: str, docker_client: docker.DockerClient
) -> Iterator[Restarted]:
    name = f"rebind-{secrets.token_hex(3)}"
    # Ticks of 0.5 s: the journal's writes.
    cli, gateway, model = up_with_sandboxes(
        tmp_path_factory.mktemp("sandbox-restart"), name, module_sandbox_image, time_scale=0.05, tick_interval_s=0.5
    )
    agents_own = None
    try:
        chat(gateway, model, "kept")  # its first request: it may adopt containers started from now on
        made = ready_sandbox(gateway, "kept", env={"GREETING": "hello"})
        agents_own = run_by_hand(docker_client, module_sandbox_image)
        adoption = httpx.post(
            f"{gateway}/v1/sandboxes/adopt", json={"program_id": "kept", "docker_ids": [agents_own.id]}, timeout=30
        )
        adoption.raise_for_status()
        [adopted] = adoption.json()["sandboxes"]
        chat(gateway, model, "done")
        released = ready_sandbox(gateway, "done")
        httpx.post(f"{gateway}/programs/release", json={"program_id": "done"}, timeout=30).raise_for_status()
        unknown = ready_sandbox(gateway, "stranger")
        # The journal's next write holds "kept" and no longer "done": then the daemon dies.
        before = time.time()
        wait_for(lambda: (cli.status().daemon.journal.written_at or 0.0) > before, 30, "a journal write")
        first = cli.status().daemon_pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: cli.in_process("status", "--json").exit_code == 0 and cli.status().daemon_pid != first,
                 60, "the daemon started again")  # fmt: skip
        sandboxes = {"made": made, "adopted": adopted, "released": released, "unknown": unknown}
        yield Restarted(
            gateway,
            **{kind: sandbox["id"] for kind, sandbox in sandboxes.items()},
            containers={sandbox["id"]: sandbox["container_id"] for sandbox in sandboxes.values()},
        )
    finally:
        cli("down", check=False)
        if agents_own is not None and container_exists(docker_client, agents_own.id):
            agents_own.remove(force=True, v=True)
        for container in docker_client.containers.list(all=True, filters={"label": f"thunderctl.cluster={name}"}):
            container.remove(force=True, v=True)


@pytest.mark.parametrize(
    ("kind", "cmd", "output"),
    [("made", "echo $GREETING", "hello\n"), ("adopted", "echo inside", "inside\n")],  # made's with its env
)
def test_a_restored_programs_sandbox_is_still_there_and_runs_its_next_exec(
    restarted: Restarted, docker_client: docker.DockerClient, kind: str, cmd: str, output: str
) -> None:
    sandbox_id = getattr(restarted, kind)
    assert container_exists(docker_client, restarted.containers[sandbox_id])
    ran = exec_in(restarted.gateway, sandbox_id, cmd)
    assert ran.status_code == 200 and ran.json()["output"] == output


def test_the_sandboxes_of_a_program_released_before_the_kill_or_never_heard_of_are_gone(
    restarted: Restarted, docker_client: docker.DockerClient
) -> None:
    for sandbox_id in (restarted.released, restarted.unknown):
        assert not container_exists(docker_client, restarted.containers[sandbox_id])
        assert exec_in(restarted.gateway, sandbox_id, "true").status_code == 404


def test_the_restored_programs_release_removes_its_sandboxes(
    restarted: Restarted, docker_client: docker.DockerClient
) -> None:
    listed = httpx.get(f"{restarted.gateway}/v1/sandboxes", params={"program_id": "kept"}, timeout=30).json()
    assert {sb["id"] for sb in listed["sandboxes"]} == {restarted.made, restarted.adopted}

    httpx.post(f"{restarted.gateway}/programs/release", json={"program_id": "kept"}, timeout=30).raise_for_status()
    kept = [restarted.containers[restarted.made], restarted.containers[restarted.adopted]]
    wait_for(lambda: not any(container_exists(docker_client, c) for c in kept), 30, "the sandboxes removed")
    assert exec_in(restarted.gateway, restarted.made, "true").status_code == 404
