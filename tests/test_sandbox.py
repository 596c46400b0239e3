"""The sandbox pool against a real Docker engine (scripts/start-dockerd.sh), over real HTTP where
an agent would use it. Needs the sandbox_fixtures plugin."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import httpx
import pytest
import yaml
from docker.errors import NotFound

from support import container_exists, eventually, run_by_hand, up_with_sandboxes, wait_for
from thunderctl.cluster.install import docker_command
from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.service import collect_orphaned_sandboxes
from thunderctl.profile import DEFAULT_PROFILE, EngineSpec
from thunderctl.prometheus import parse_samples
from thunderctl.sandbox import SandboxConfig, SandboxPool
from thunderctl.sandbox.config import LOCAL_DOCKER
from thunderctl.sandbox.docker_host import DockerHost
from thunderctl.sandbox.metrics import render_sandbox_metrics

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # the pool is asyncio code; anyio would also try trio where it is installed


REPO = Path(__file__).resolve().parent.parent


def labelled(client: docker.DockerClient, cluster: str) -> list:
    # sparse: one listing call, no inspection of a container being removed meanwhile
    return client.containers.list(all=True, sparse=True, filters={"label": f"thunderctl.cluster={cluster}"})


async def test_acquire_exec_release_round_trip_over_http(start_pool, serve_pool, docker_client) -> None:
    pool = await start_pool()
    http = await serve_pool(pool)

    created = await http.post("/v1/sandboxes", json={"program_id": "p1", "env": {"GREETING": "hello"}})
    assert created.status_code == 201
    sandbox = created.json()
    assert sandbox["state"] in ("preparing", "ready") and sandbox["host"] == "unix:///var/run/docker.sock"

    ready = (await http.get(f"/v1/sandboxes/{sandbox['id']}", params={"wait": "ready"})).json()
    assert ready["state"] == "ready" and ready["program_id"] == "p1"
    assert docker_client.containers.get(ready["container_id"]).status == "running"

    ran = await http.post(
        f"/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "echo $GREETING; echo oops >&2; exit 3", "timeout": 10}
    )
    assert ran.status_code == 200
    result = ran.json()
    assert result["exit_code"] == 3 and result["output"] == "hello\noops\n" and not result["timed_out"]
    assert result["duration_s"] < 5

    listed = (await http.get("/v1/sandboxes", params={"program_id": "p1"})).json()["sandboxes"]
    assert [s["id"] for s in listed] == [sandbox["id"]]

    assert (await http.delete(f"/v1/sandboxes/{sandbox['id']}")).status_code == 200
    assert not container_exists(docker_client, ready["container_id"])
    gone = await http.post(f"/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "true"})
    assert gone.status_code == 404 and sandbox["id"] in gone.json()["error"]["message"]
    assert (await http.get(f"/v1/sandboxes/{sandbox['id']}")).status_code == 404
    assert (await http.delete(f"/v1/sandboxes/{sandbox['id']}")).status_code == 404


async def test_bad_requests_are_400s_naming_the_field(start_pool, serve_pool) -> None:
    http = await serve_pool(await start_pool())
    assert (await http.post("/v1/sandboxes", content=b"{nope")).status_code == 400
    missing = await http.post("/v1/sandboxes", json={"image": "x"})
    assert missing.status_code == 400 and "program_id" in missing.json()["error"]["message"]
    bad_env = await http.post("/v1/sandboxes", json={"program_id": "p", "env": {"A": 1}})
    assert bad_env.status_code == 400 and "env" in bad_env.json()["error"]["message"]


async def test_limits_and_isolation_are_applied(start_pool, docker_client) -> None:
    pool = await start_pool(memory="64m", pids=64, nofile=1024, cpus=0.5)
    sandbox = await pool.wait_ready((await pool.acquire("p1")).id, 30)

    host_config = docker_client.api.inspect_container(sandbox.container_id)["HostConfig"]
    assert host_config["Memory"] == 64 * 2**20
    assert host_config["MemorySwap"] == 64 * 2**20  # swap equal to memory: none
    assert host_config["PidsLimit"] == 64
    assert host_config["NanoCpus"] == 500_000_000
    assert host_config["CapDrop"] == ["ALL"]
    assert host_config["SecurityOpt"] == ["no-new-privileges"]
    assert host_config["NetworkMode"] == "none"
    assert host_config["Ulimits"] == [{"Name": "nofile", "Soft": 1024, "Hard": 1024}]

    # And as the agent sees it: loopback only, the file limit, and no capabilities.
    seen = await pool.exec(sandbox.id, "ls /sys/class/net; ulimit -n; grep CapEff /proc/self/status")
    assert seen.output.split() == ["lo", "1024", "CapEff:", "0000000000000000"]


async def test_exec_timeout_kills_the_command_and_its_children(start_pool) -> None:
    pool = await start_pool()
    sandbox = await pool.wait_ready((await pool.acquire("p1")).id, 30)

    result = await pool.exec(sandbox.id, "sleep 300 & echo started; sleep 301; echo never", timeout_s=1)
    assert result.timed_out and result.exit_code == 137
    assert result.output == "started\n"
    assert 1 <= result.duration_s < 5

    left = await pool.exec(sandbox.id, "ps -o args")
    assert "sleep 30" not in left.output  # neither the command nor what it put in the background
    assert (await pool.exec(sandbox.id, "echo still usable")).output == "still usable\n"


async def test_hundred_programs_leave_no_container_behind(start_pool, sandbox_cluster, docker_client) -> None:
    pool = await start_pool(prepare_concurrency=6)
    sandboxes = [await pool.acquire(f"program-{n}") for n in range(100)]
    ready = await asyncio.gather(*(pool.wait_ready(sb.id, 120) for sb in sandboxes))
    assert {sb.state for sb in ready} == {"ready"}
    assert len(labelled(docker_client, sandbox_cluster)) == 100
    assert pool.stats()["bound"] == 100 and pool.stats()["prepare_s"]["count"] == 100

    ended = await asyncio.gather(*(pool.program_ended(f"program-{n}") for n in range(100)))
    assert sum(ended) == 100
    assert labelled(docker_client, sandbox_cluster) == []
    assert pool.stats()["bound"] == 0 and pool.sandboxes() == []


def created_since(client: docker.DockerClient, cluster: str, since: float) -> list[str]:
    """The program label of each container of the cluster Docker created since `since` (Unix
    time), in creation order: what was ever made, even if it is gone now."""
    events = client.events(
        since=int(since),
        until=int(time.time()) + 1,
        decode=True,
        filters={"type": "container", "event": "create", "label": f"thunderctl.cluster={cluster}"},
    )
    return [event["Actor"]["Attributes"]["thunderctl.program"] for event in events]


async def test_a_sandbox_released_before_it_is_ready_leaves_no_container(
    start_pool, serve_pool, sandbox_cluster, docker_client
) -> None:
    since = time.time()
    pool = await start_pool(prepare_concurrency=1)
    http = await serve_pool(pool)
    in_setup = (await http.post("/v1/sandboxes", json={"program_id": "p1", "setup": "sleep 600"})).json()
    not_begun = (await http.post("/v1/sandboxes", json={"program_id": "p2"})).json()  # waits for the only slot
    await eventually(lambda: len(labelled(docker_client, sandbox_cluster)) == 1, timeout=30, what="p1's container")

    # p2 first: p1's release frees the slot p2 waits for.
    for sandbox in (not_begun, in_setup):
        assert (await http.delete(f"/v1/sandboxes/{sandbox['id']}")).status_code == 200
    # Well within the setup's 600 s: its container goes at the release, not when the setup ends.
    await eventually(lambda: labelled(docker_client, sandbox_cluster) == [], timeout=30, what="no container")
    assert await asyncio.to_thread(created_since, docker_client, sandbox_cluster, since) == ["p1"]
    assert pool.stats()["preparing"] == 0 and pool.stats()["queued_for_preparation"] == 0


async def test_a_programs_end_removes_each_of_its_sandboxes_and_no_other(
    start_pool, sandbox_image, sandbox_cluster, docker_client
) -> None:
    pool = await start_pool(warm=1)
    await eventually(lambda: pool.stats()["warm"] == 1, timeout=30, what="a warm sandbox")
    pool.program_began("p1")
    from_warm = await pool.acquire("p1")
    prepared = await pool.wait_ready((await pool.acquire("p1", setup="true")).id, 30)
    agents_own = run_by_hand(docker_client, sandbox_image)
    await pool.adopt("p1", [agents_own.id])
    others = await pool.wait_ready((await pool.acquire("p2")).id, 30)
    await eventually(lambda: pool.stats()["warm"] == 1, timeout=30, what="the warm pool refilled")

    assert await pool.program_ended("p1") == 3
    for container_id in (from_warm.container_id, prepared.container_id, agents_own.id):
        assert not container_exists(docker_client, container_id)
    left = {container.id: container.status for container in labelled(docker_client, sandbox_cluster)}
    assert len(left) == 2 and left[others.container_id] == "running"  # p2's and the warm one
    assert [sb.program_id for sb in pool.sandboxes()] == ["p2"]


async def test_shutdown_removes_every_container_of_the_pool_warm_bound_and_adopted(
    sandbox_config, sandbox_cluster, sandbox_image, docker_client
) -> None:
    pool = SandboxPool(sandbox_config(warm=2), cluster=sandbox_cluster)
    await pool.start()
    try:
        pool.program_began("p1")
        await pool.wait_ready((await pool.acquire("p1", setup="true")).id, 30)
        agents_own = run_by_hand(docker_client, sandbox_image)
        await pool.adopt("p1", [agents_own.id])
        await eventually(lambda: pool.stats()["warm"] == 2, timeout=30, what="two warm sandboxes")
        assert len(labelled(docker_client, sandbox_cluster)) == 3
    finally:
        await pool.shutdown()  # `down`
    assert labelled(docker_client, sandbox_cluster) == []
    assert not container_exists(docker_client, agents_own.id)


# The first daemon, in a process of its own: 20 sandboxes, then it waits to be killed.
CRASHING_DAEMON = """
import asyncio, sys
from thunderctl.sandbox import SandboxConfig, SandboxPool
from thunderctl.sandbox.metrics import render_sandbox_metrics

async def main(image, cluster):
    pool = SandboxPool(SandboxConfig(image=image, memory="64m", prepare_concurrency=6), cluster=cluster)
    await pool.start()
    sandboxes = [await pool.acquire(f"program-{n}") for n in range(20)]
    for sandbox in sandboxes:
        await pool.wait_ready(sandbox.id, 120)
    print(sum(sb.state == "ready" for sb in sandboxes), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_restart_after_kill_9_reaps_every_orphan_and_nothing_else(
    start_pool, sandbox_cluster, sandbox_image, docker_client
) -> None:
    daemon = subprocess.Popen(
        [sys.executable, "-c", CRASHING_DAEMON, sandbox_image, sandbox_cluster],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    try:
        ready_line = await asyncio.wait_for(asyncio.to_thread(daemon.stdout.readline), 120)
    finally:
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
    assert ready_line.strip() == b"20"
    assert len(labelled(docker_client, sandbox_cluster)) == 20

    # Containers the reaper must not touch: unlabelled, and another cluster's.
    bystanders = [
        docker_client.containers.run(
            sandbox_image, ["sleep", "600"], detach=True, network_mode="none", labels=labels | {"thunderctl.test": "1"}
        )
        for labels in ({}, {"thunderctl.cluster": f"{sandbox_cluster}-other"})
    ]

    pool = await start_pool()
    assert labelled(docker_client, sandbox_cluster) == []
    assert pool.stats()["reaped"] == 20
    for bystander in bystanders:
        bystander.reload()
        assert bystander.status == "running"


async def test_adopted_container_is_collected_with_its_program(
    start_pool, serve_pool, sandbox_image, docker_client
) -> None:
    pool = await start_pool()
    http = await serve_pool(pool)
    pool.program_began("p1")  # its first request, before its agent starts the container
    agents_own = run_by_hand(docker_client, sandbox_image)

    adopted = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": [agents_own.short_id]})
    assert adopted.status_code == 200
    [sandbox] = adopted.json()["sandboxes"]
    assert sandbox["container_id"] == agents_own.id and sandbox["adopted"] and sandbox["state"] == "ready"
    ran = await http.post(f"/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "echo inside"})
    assert ran.json()["output"] == "inside\n"

    await pool.program_ended("p1")
    assert not container_exists(docker_client, agents_own.id)

    unknown = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": ["f00dfeed"]})
    assert unknown.status_code == 404 and "f00dfeed" in unknown.json()["error"]["message"]


async def test_a_container_older_than_the_program_or_another_clusters_survives_adopt_and_release(
    start_pool, serve_pool, sandbox_image, docker_client
) -> None:
    bystander = run_by_hand(docker_client, sandbox_image)  # a database, say, started before the program
    pool = await start_pool()
    http = await serve_pool(pool)
    pool.program_began("p1")
    other_clusters = run_by_hand(
        docker_client, sandbox_image, **{"thunderctl.cluster": "prod", "thunderctl.role": "worker"}
    )
    agents_own = run_by_hand(docker_client, sandbox_image)
    try:
        for refused, why in [(bystander, "before program 'p1' began"), (other_clusters, "cluster 'prod'")]:
            answer = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": [refused.short_id]})
            assert answer.status_code == 403 and why in answer.json()["error"]["message"]
        taken = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": [agents_own.id]})
        assert taken.status_code == 200

        await pool.program_ended("p1")
        assert container_exists(docker_client, bystander.id) and container_exists(docker_client, other_clusters.id)
        assert not container_exists(docker_client, agents_own.id)
    finally:
        for container in (bystander, other_clusters, agents_own):
            with contextlib.suppress(NotFound):
                container.remove(force=True)


async def test_another_programs_sandbox_and_a_warm_one_cannot_be_adopted(
    start_pool, serve_pool, sandbox_image, sandbox_cluster, docker_client
) -> None:
    pool = await start_pool(warm=1)
    http = await serve_pool(pool)
    pool.program_began("b")  # b began before every container here: by their age alone it could take them
    pool.program_began("a")
    agents_own = run_by_hand(docker_client, sandbox_image)
    await eventually(lambda: pool.stats()["warm"] == 1, timeout=30, what="a warm sandbox")
    [adopted] = (
        await http.post("/v1/sandboxes/adopt", json={"program_id": "a", "docker_ids": [agents_own.id]})
    ).json()["sandboxes"]
    from_warm = (await http.post("/v1/sandboxes", json={"program_id": "a"})).json()  # born with no program label
    await eventually(lambda: pool.stats()["warm"] == 1, timeout=30, what="the warm pool refilled")
    [warm] = {c.id for c in labelled(docker_client, sandbox_cluster)} - {from_warm["container_id"]}

    for sandbox in (adopted, from_warm):
        for docker_id in (sandbox["container_id"], sandbox["container_id"][:12]):
            refused = await http.post("/v1/sandboxes/adopt", json={"program_id": "b", "docker_ids": [docker_id]})
            assert refused.status_code == 403, refused.text
            assert f"sandbox {sandbox['id']} of program 'a'" in refused.json()["error"]["message"]
    refused = await http.post("/v1/sandboxes/adopt", json={"program_id": "b", "docker_ids": [warm]})
    assert refused.status_code == 403 and "warm pool" in refused.json()["error"]["message"]
    assert (await http.get("/v1/sandboxes", params={"program_id": "b"})).json() == {"sandboxes": []}

    await pool.program_ended("b")
    for container_id in (adopted["container_id"], from_warm["container_id"], warm):
        assert docker_client.containers.get(container_id).status == "running"
    again = await http.post(
        "/v1/sandboxes/adopt", json={"program_id": "a", "docker_ids": [agents_own.id, from_warm["container_id"]]}
    )
    assert [sb["id"] for sb in again.json()["sandboxes"]] == [adopted["id"], from_warm["id"]]  # its own, as they are


async def test_adopt_off_refuses_and_the_container_outlives_the_program(
    start_pool, serve_pool, sandbox_image, docker_client
) -> None:
    pool = await start_pool(adopt="off")
    http = await serve_pool(pool)
    pool.program_began("p1")
    agents_own = run_by_hand(docker_client, sandbox_image)
    try:
        refused = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": [agents_own.id]})
        assert refused.status_code == 403 and "sandboxes.adopt: off" in refused.json()["error"]["message"]
        await pool.program_ended("p1")
        assert docker_client.containers.get(agents_own.id).status == "running"
    finally:
        agents_own.remove(force=True)


async def test_restart_collects_containers_adopted_before_a_crash(
    start_pool, sandbox_config, sandbox_cluster, sandbox_image, docker_client, tmp_path
) -> None:
    state_path = tmp_path / "sandboxes.json"
    first = SandboxPool(sandbox_config(), cluster=sandbox_cluster, state_path=state_path)
    await first.start()
    first.program_began("p1")
    agents_own = run_by_hand(docker_client, sandbox_image)
    await first.adopt("p1", [agents_own.id])
    # The first daemon "dies" here: nothing released, only its state file is left for the next.

    await start_pool(state_path=state_path)
    assert not container_exists(docker_client, agents_own.id)
    await first.shutdown()  # the dead daemon's threads and timers, not its containers


async def test_preparation_follows_the_resume_queue(start_pool) -> None:
    pool = await start_pool(prepare_concurrency=1)
    blocker = await pool.acquire("blocker", setup="sleep 1")  # holds the only slot
    waiting = [await pool.acquire(f"waiting-{n}") for n in range(5)]
    pool.program_queue(["waiting-3", "waiting-1", "waiting-4", "waiting-0", "waiting-2"])
    running = await pool.acquire("running")  # not waiting for GPU memory: needs its sandbox now

    finished: list[str] = []

    async def note_when_ready(sandbox_id: str) -> None:
        sandbox = await pool.wait_ready(sandbox_id, 60)
        finished.append(sandbox.program_id)

    await asyncio.gather(*(note_when_ready(sb.id) for sb in [blocker, *waiting, running]))
    assert finished == ["blocker", "running", "waiting-3", "waiting-1", "waiting-4", "waiting-0", "waiting-2"]


async def test_warm_pool_hands_out_at_once_and_refills(start_pool, serve_pool, sandbox_cluster, docker_client) -> None:
    pool = await start_pool(warm=2)
    http = await serve_pool(pool)
    await eventually(lambda: pool.stats()["warm"] == 2, timeout=30)

    started = time.monotonic()
    created = (await http.post("/v1/sandboxes", json={"program_id": "p1"})).json()
    assert created["state"] == "ready" and created["container_id"] is not None
    ran = await http.post(f"/v1/sandboxes/{created['id']}/exec", json={"cmd": "echo warm"})
    assert ran.json()["output"] == "warm\n"
    assert time.monotonic() - started < 1.0  # no container was made on the way
    await eventually(lambda: pool.stats()["warm"] == 2, timeout=30)
    assert pool.stats()["bound"] == 1
    metrics = {(s.name, tuple(s.labels.items())): s.value for s in parse_samples(render_sandbox_metrics(pool.stats()))}
    assert metrics[("thunderctl_sandboxes", (("state", "warm"),))] == 2
    assert metrics[("thunderctl_sandboxes", (("state", "bound"),))] == 1
    assert metrics[("thunderctl_sandbox_acquire_to_ready_seconds_count", ())] == 1

    # A warm container that died is replaced at the next maintenance.
    warm = [c for c in labelled(docker_client, sandbox_cluster) if c.id != created["container_id"]]
    assert len(warm) == 2
    warm[0].kill()
    await pool.maintain()
    await eventually(lambda: pool.stats()["warm"] == 2, timeout=30)
    assert not container_exists(docker_client, warm[0].id)
    assert len(labelled(docker_client, sandbox_cluster)) == 3  # two warm, one bound


async def test_a_warm_sandbox_runs_the_requests_setup_before_it_is_ready(start_pool, serve_pool) -> None:
    pool = await start_pool(warm=1)
    http = await serve_pool(pool)
    await eventually(lambda: pool.stats()["warm"] == 1, timeout=30, what="a warm sandbox")
    body = {"program_id": "p1", "setup": "echo $TOKEN > /marker", "env": {"TOKEN": "checked-out"}}
    created = (await http.post("/v1/sandboxes", json=body)).json()
    assert created["state"] == "preparing" and created["container_id"] is not None  # the warm one, set up now
    ready = (await http.get(f"/v1/sandboxes/{created['id']}", params={"wait": "ready"})).json()
    assert ready["state"] == "ready" and ready["container_id"] == created["container_id"]
    ran = await http.post(f"/v1/sandboxes/{created['id']}/exec", json={"cmd": "cat /marker"})
    assert ran.json()["output"] == "checked-out\n"
    await eventually(lambda: pool.stats()["warm"] == 1, timeout=30, what="the warm pool refilled")


async def test_setup_runs_before_ready_and_its_failure_is_reported(start_pool, serve_pool) -> None:
    pool = await start_pool()
    http = await serve_pool(pool)
    made = (await http.post("/v1/sandboxes", json={"program_id": "p1", "setup": "echo prepared > /marker"})).json()
    ran = await http.post(f"/v1/sandboxes/{made['id']}/exec", json={"cmd": ["cat", "/marker"]})
    assert ran.json()["output"] == "prepared\n"

    broken = (await http.post("/v1/sandboxes", json={"program_id": "p2", "setup": "echo no such repo; exit 7"})).json()
    waited = await http.get(f"/v1/sandboxes/{broken['id']}", params={"wait": "ready"})
    assert waited.status_code == 422
    message = waited.json()["error"]["message"]
    assert "exited 7" in message and "no such repo" in message


async def test_missing_image_is_a_clear_error_and_the_pool_keeps_working(start_pool, serve_pool, unused_port) -> None:
    pool = await start_pool()
    http = await serve_pool(pool)
    missing = f"127.0.0.1:{unused_port}/thunderctl-test/missing:1"  # a registry that refuses at once

    created = await http.post("/v1/sandboxes", json={"program_id": "p1", "image": missing})
    assert created.status_code == 201
    waited = await http.get(f"/v1/sandboxes/{created.json()['id']}", params={"wait": "ready"})
    assert waited.status_code == 422
    assert missing in waited.json()["error"]["message"]
    assert missing in pool.stats()["last_error"]

    ok = (await http.post("/v1/sandboxes", json={"program_id": "p1"})).json()
    ran = await http.post(f"/v1/sandboxes/{ok['id']}/exec", json={"cmd": "echo fine"})
    assert ran.json()["output"] == "fine\n"


async def test_unreachable_docker_host_is_named_and_nothing_crashes(start_pool, serve_pool, unused_port) -> None:
    url = f"tcp://127.0.0.1:{unused_port}"
    pool = await start_pool(hosts=[url], warm=2)
    http = await serve_pool(pool)

    stats = pool.stats()
    assert not stats["available"] and url in stats["reason"]
    refused = await http.post("/v1/sandboxes", json={"program_id": "p1"})
    assert refused.status_code == 503 and url in refused.json()["error"]["message"]
    assert (await http.get("/v1/sandboxes")).json() == {"sandboxes": []}
    await pool.maintain()  # the periodic round survives a host that does not answer
    assert not pool.stats()["available"]


async def test_one_unreachable_host_of_two_leaves_the_other_serving(start_pool, unused_port) -> None:
    down = f"tcp://127.0.0.1:{unused_port}"
    pool = await start_pool(hosts=[down, "unix:///var/run/docker.sock"])
    sandbox = await pool.wait_ready((await pool.acquire("p1")).id, 30)
    assert sandbox.state == "ready" and sandbox.host.url == "unix:///var/run/docker.sock"
    assert pool.stats()["available"] and pool.stats()["hosts"][0]["available"] is False


async def test_idle_sandbox_expires(start_pool, docker_client) -> None:
    pool = await start_pool(idle_expiry_s=0.5)
    sandbox = await pool.wait_ready((await pool.acquire("p1")).id, 30)
    await asyncio.sleep(1.0)
    await pool.maintain()
    await eventually(lambda: not container_exists(docker_client, sandbox.container_id), timeout=30)
    assert pool.sandboxes("p1") == []


def test_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="memory"):
        SandboxConfig(memory="lots")
    with pytest.raises(ValueError, match="ssh://"):
        SandboxConfig(hosts=["docker.example:2375"])


async def test_image_named_in_a_request_is_pulled_when_missing(start_pool, serve_pool, publish_image) -> None:
    reference = publish_image()
    http = await serve_pool(await start_pool())
    created = (await http.post("/v1/sandboxes", json={"program_id": "p1", "image": reference})).json()
    ran = await http.post(f"/v1/sandboxes/{created['id']}/exec", json={"cmd": "cat /pulled"})
    assert ran.status_code == 200 and ran.json()["output"] == reference.rsplit(":", 1)[1] + "\n"


async def test_disk_above_watermark_evicts_pulled_images_no_container_uses(
    start_pool, publish_image, sandbox_image, docker_client
) -> None:
    in_use, unused = publish_image(), publish_image()
    pool = await start_pool(disk_high_watermark="1k")  # anything pulled is over it
    kept = await pool.wait_ready((await pool.acquire("p1", image=in_use)).id, 60)
    done = await pool.wait_ready((await pool.acquire("p2", image=unused)).id, 60)
    assert {kept.state, done.state} == {"ready"}
    await pool.program_ended("p2")

    before = time.monotonic()
    await pool.maintain()
    stats = pool.stats()
    assert stats["evicted_images"] == 1 and stats["disk_bytes"] > 1024
    assert 0 <= stats["hosts"][0]["disk_age_s"] <= time.monotonic() - before  # measured by this round
    with pytest.raises(NotFound):
        docker_client.images.get(unused)
    docker_client.images.get(in_use)  # its container still runs
    docker_client.images.get(sandbox_image)  # not pulled by the pool: never evicted


def worker_labels(cluster: str) -> dict[str, str]:
    """The labels `up` gives a Docker-installed vLLM worker, read off its real `docker run` line."""
    command = docker_command(
        EngineSpec(install="docker", version="0.11.0"),
        cluster,
        "node-1/0",
        [0],
        ("127.0.0.1", 8100),
        "Qwen/Qwen3-32B",
        [],
    )
    return dict(value.split("=", 1) for flag, value in zip(command, command[1:]) if flag == "--label")


@pytest.fixture
def run_labelled(
    docker_client, sandbox_image
) -> Iterator[Callable[[dict[str, str]], docker.models.containers.Container]]:
    """Run a `sleep` of the test image with exactly the given labels; removed by id afterwards."""
    made = []

    def run(labels: dict[str, str]):
        container = docker_client.containers.run(
            sandbox_image, ["sleep", "600"], detach=True, network_mode="none", labels=labels
        )
        made.append(container)
        return container

    yield run
    for container in made:
        with contextlib.suppress(NotFound):
            container.remove(force=True, v=True)


def orphaned_sandbox(config: SandboxConfig, cluster: str, image: str, lease: str) -> str:
    """A sandbox container as a pool that died made it: created by the pool's own Docker code."""
    host = DockerHost(LOCAL_DOCKER, config, cluster)
    assert host.connect(), host.reason
    try:
        return host.create(image, lease, program_id="gone")
    finally:
        host.close()


def down_state(directory: Path, cluster: str, sandbox_image: str) -> ClusterState:
    """A cluster's state as `down` finds it, its profile naming the local engine for sandboxes."""
    profile = yaml.safe_load(DEFAULT_PROFILE.read_text())
    profile["sandboxes"] = {"image": sandbox_image, "memory": "64m", "maintenance_interval_s": 3600}
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return ClusterState(cluster, directory / cluster, str(path), "http://127.0.0.1:1/v1")


async def test_workers_on_the_pools_engine_survive_reaping_and_downs_sweep(
    start_pool, sandbox_config, sandbox_cluster, sandbox_image, run_labelled, docker_client, tmp_path
) -> None:
    labels = worker_labels(sandbox_cluster)
    assert labels["thunderctl.cluster"] == sandbox_cluster and labels["thunderctl.role"] == "worker"
    worker = run_labelled(labels)
    # One started by a thunderctl from before roles: the cluster and worker labels only.
    older_worker = run_labelled({k: v for k, v in labels.items() if k != "thunderctl.role"})
    orphan = orphaned_sandbox(sandbox_config(), sandbox_cluster, sandbox_image, "sbx-orphaned")
    # A sandbox an older thunderctl left: no role label, but a lease, which no worker ever had.
    older_orphan = run_labelled(
        {"thunderctl.cluster": sandbox_cluster, "thunderctl.program": "", "thunderctl.lease": "sbx-older"}
    )

    pool = await start_pool()
    await pool.maintain()
    assert pool.stats()["reaped"] == 2
    assert not container_exists(docker_client, orphan) and not container_exists(docker_client, older_orphan.id)
    for bystander in (worker, older_worker):
        bystander.reload()
        assert bystander.status == "running"

    # `down` of a cluster whose daemon is dead sweeps with a pool of its own.
    swept = orphaned_sandbox(sandbox_config(), sandbox_cluster, sandbox_image, "sbx-swept")
    swept_now = await collect_orphaned_sandboxes(down_state(tmp_path, sandbox_cluster, sandbox_image))
    assert (swept_now.removed, swept_now.left) == (1, [])
    assert not container_exists(docker_client, swept)
    for bystander in (worker, older_worker):
        bystander.reload()
        assert bystander.status == "running"


async def test_sandbox_containers_carry_the_sandbox_role(start_pool, docker_client) -> None:
    pool = await start_pool()
    sandbox = await pool.wait_ready((await pool.acquire("p1")).id, 30)
    labels = docker_client.containers.get(sandbox.container_id).labels
    assert labels["thunderctl.role"] == "sandbox" and labels["thunderctl.lease"] == sandbox.id


async def test_adopt_any_takes_an_older_container_but_never_this_clusters_worker_or_sandbox(
    start_pool, serve_pool, sandbox_config, sandbox_cluster, sandbox_image, run_labelled, docker_client
) -> None:
    older = run_labelled({"thunderctl.test": "1"})  # started by hand before the program
    worker = run_labelled(worker_labels(sandbox_cluster))
    pool = await start_pool(adopt="any")
    http = await serve_pool(pool)
    orphan = orphaned_sandbox(sandbox_config(), sandbox_cluster, sandbox_image, "sbx-orphaned")  # after the reap
    pool.program_began("p1")

    for refused_id, why in [(worker.id, "this cluster's own worker"), (orphan, "this cluster's own sandbox")]:
        refused = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": [refused_id]})
        assert refused.status_code == 403 and why in refused.json()["error"]["message"], refused.text
    taken = await http.post("/v1/sandboxes/adopt", json={"program_id": "p1", "docker_ids": [older.short_id]})
    assert taken.status_code == 200, taken.text

    await pool.program_ended("p1")
    assert not container_exists(docker_client, older.id)
    assert docker_client.containers.get(worker.id).status == "running"


def test_through_the_daemon_a_chat_adopts_the_agents_own_container_and_not_an_older_one(
    sandbox_image, sandbox_cluster, docker_client, tmp_path
) -> None:
    """`docker_ids` in a chat body, as an agent sends them: what it started after its first request
    goes with the program, a container from before is left alone and the refusal is logged."""
    bystander = run_by_hand(docker_client, sandbox_image)
    cli, gateway, model = up_with_sandboxes(tmp_path, sandbox_cluster, sandbox_image, time_scale=0.0)
    agents_own = None
    try:
        body = {
            "model": model,
            "program_id": "agent",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60).status_code == 200
        agents_own = run_by_hand(docker_client, sandbox_image)
        for container in (bystander, agents_own):
            sent = body | {"docker_ids": [container.short_id]}
            assert httpx.post(f"{gateway}/v1/chat/completions", json=sent, timeout=60).status_code == 200

        def adopted() -> list[str]:
            listed = httpx.get(f"{gateway}/v1/sandboxes", params={"program_id": "agent"}, timeout=30).json()
            return [sandbox["container_id"] for sandbox in listed["sandboxes"]]

        wait_for(lambda: adopted() == [agents_own.id], 30, "the agent's own container adopted")
        daemon_log = ClusterState.load(tmp_path / "state" / sandbox_cluster).daemon_log
        wait_for(lambda: "not adopted" in daemon_log.read_text(), 30, "the refusal logged")
        assert f"{bystander.short_id} was created" in daemon_log.read_text()

        httpx.post(f"{gateway}/programs/release", json={"program_id": "agent"}, timeout=30).raise_for_status()
        wait_for(lambda: not container_exists(docker_client, agents_own.id), 30, "the adopted container removed")
        assert container_exists(docker_client, bystander.id)
    finally:
        cli("down", check=False)
        for container in (bystander, agents_own):
            if container is not None:
                with contextlib.suppress(NotFound):
                    container.remove(force=True)
