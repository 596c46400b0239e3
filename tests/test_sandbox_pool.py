"""The sandbox pool's logic over an in-memory Docker engine (tests/fake_docker.py) and a virtual
clock: preparation order and limits, the warm pool, leases, the reaper, adoption, idle expiry,
the disk watermark and exec timeouts. tests/test_sandbox.py checks the same on a real dockerd."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from fake_docker import Command, FakeEngine, fake_hosts
from support import eventually
from thunderctl.docker_labels import LABEL_CLUSTER, LABEL_LEASE, LABEL_PROGRAM, LABEL_ROLE, ROLE_WORKER
from thunderctl.prometheus import parse_samples
from thunderctl.sandbox import (
    AdoptionRefused,
    PoolUnavailable,
    Sandbox,
    SandboxConfig,
    SandboxFailed,
    SandboxNotFound,
    SandboxPool,
    sandbox_routes,
)
from thunderctl.sandbox.metrics import render_sandbox_metrics
from thunderctl.sim.clock import VirtualClock

pytestmark = pytest.mark.anyio

LOCAL = "unix:///var/run/docker.sock"
OTHER = "tcp://127.0.0.1:2375"  # never dialled: the fake engine answers for it
IMAGE = "busybox:latest"
CLUSTER = "fake"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(now=1000.0)


@pytest.fixture
def engines(clock: VirtualClock) -> dict[str, FakeEngine]:
    return {
        LOCAL: FakeEngine(images={IMAGE: 4_000_000}, clock=clock),
        OTHER: FakeEngine(images={IMAGE: 4_000_000}, clock=clock),
    }


@pytest.fixture
async def start_pool(
    engines: dict[str, FakeEngine], clock: VirtualClock
) -> AsyncIterator[Callable[..., Awaitable[SandboxPool]]]:
    """Start pools on the fake engines (LOCAL unless `hosts` says otherwise); shut down afterwards."""
    pools: list[SandboxPool] = []

    async def start(
        state_path: Path | None = None, live_programs: tuple[str, ...] = (), **overrides: object
    ) -> SandboxPool:
        config = SandboxConfig(**({"image": IMAGE, "hosts": [LOCAL], "maintenance_interval_s": 3600} | overrides))
        pool = SandboxPool(config, CLUSTER, state_path, host_factory=fake_hosts(engines), clock=clock, wall_clock=clock)
        pools.append(pool)
        await pool.start(live_programs)
        return pool

    yield start
    for engine in engines.values():
        engine.creating_allowed.set()  # a failed test may have left preparations held
    for pool in pools:
        await pool.shutdown()


async def settle() -> None:
    """Give background work that should NOT happen the chance to (the fake answers at once)."""
    for _ in range(10):
        await asyncio.sleep(0.005)


async def ready(pool: SandboxPool, program_id: str, **options: object):
    return await pool.wait_ready((await pool.acquire(program_id, **options)).id, 10)


def sandbox_containers(engine: FakeEngine) -> list[str]:
    return [c.id for c in engine.containers.values() if c.labels.get(LABEL_CLUSTER) == CLUSTER]


async def test_acquire_exec_release_round_trip(start_pool, engines) -> None:
    engine = engines[LOCAL]
    engine.commands["echo $GREETING; exit 3"] = Command(output="hello\n", exit_code=3, seconds=0.1)
    pool = await start_pool()

    sandbox = await ready(pool, "p1", env={"GREETING": "hello"})
    assert sandbox.state == "ready" and engine.exists(sandbox.container_id)
    assert engine.containers[sandbox.container_id].labels[LABEL_PROGRAM] == "p1"

    result = await pool.exec(sandbox.id, "echo $GREETING; exit 3")
    assert (result.exit_code, result.output, result.timed_out) == (3, "hello\n", False)
    assert engine.execs[-1].env == {"GREETING": "hello"}
    assert [sb.id for sb in pool.sandboxes("p1")] == [sandbox.id]

    await pool.release(sandbox.id)
    assert not engine.exists(sandbox.container_id)
    with pytest.raises(SandboxNotFound, match=sandbox.id):
        await pool.exec(sandbox.id, "true")
    with pytest.raises(SandboxNotFound):
        await pool.release(sandbox.id)


async def test_exec_timeout_is_capped_by_the_configured_maximum(start_pool, engines) -> None:
    engine = engines[LOCAL]
    engine.commands["sleep 300"] = Command(output="started\n", seconds=300)
    pool = await start_pool(exec_timeout_s=20)
    sandbox = await ready(pool, "p1")

    killed = await pool.exec(sandbox.id, "sleep 300", timeout_s=1)
    assert killed.timed_out and killed.exit_code == 137 and killed.output == "started\n"
    await pool.exec(sandbox.id, "true", timeout_s=1000)
    await pool.exec(sandbox.id, ["ls", "/"])
    assert [call.timeout_s for call in engine.execs] == [1, 20, 20]
    assert engine.execs[-1].command == "ls /"  # a list is argv, not a shell line


async def test_preparation_follows_the_resume_queue(start_pool, engines) -> None:
    pool = await start_pool(prepare_concurrency=1)
    engines[LOCAL].creating_allowed.clear()
    blocker = await pool.acquire("blocker")
    await eventually(lambda: engines[LOCAL].in_create == 1)  # the blocker holds the only slot
    waiting = [await pool.acquire(f"waiting-{n}") for n in range(5)]
    pool.program_queue(["waiting-3", "waiting-1", "waiting-4", "waiting-0", "waiting-2"])
    running = await pool.acquire("running")  # not waiting for GPU memory: needs its sandbox now
    assert pool.stats()["queued_for_preparation"] == 6

    engines[LOCAL].creating_allowed.set()
    for sandbox in [blocker, *waiting, running]:
        await pool.wait_ready(sandbox.id, 10)
    made_for = [c.labels[LABEL_PROGRAM] for c in engines[LOCAL].created]
    assert made_for == ["blocker", "running", "waiting-3", "waiting-1", "waiting-4", "waiting-0", "waiting-2"]
    assert engines[LOCAL].most_in_create == 1


async def test_no_more_preparations_at_once_than_the_limit(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(prepare_concurrency=2)
    engine.creating_allowed.clear()
    sandboxes = [await pool.acquire(f"p{n}") for n in range(5)]
    await eventually(lambda: engine.in_create == 2)
    assert engine.in_create == 2
    assert pool.stats()["preparing"] == 5 and pool.stats()["queued_for_preparation"] == 3

    engine.creating_allowed.set()
    assert {(await pool.wait_ready(sb.id, 10)).state for sb in sandboxes} == {"ready"}
    assert engine.most_in_create == 2 and pool.stats()["bound"] == 5
    assert pool.stats()["prepare_s"]["count"] == 5


async def test_released_while_its_container_is_made_leaves_no_container(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool()
    engine.creating_allowed.clear()
    sandbox = await pool.acquire("p1")
    await eventually(lambda: engine.in_create == 1)
    assert engine.in_create == 1
    await pool.release(sandbox.id)
    engine.creating_allowed.set()
    await eventually(lambda: len(engine.created) == 1 and sandbox_containers(engine) == [])
    assert len(engine.created) == 1 and sandbox_containers(engine) == []
    assert sandbox.state == "released"


async def test_released_before_its_turn_never_gets_a_container(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(prepare_concurrency=1)
    engine.creating_allowed.clear()
    first = await pool.acquire("first")
    second = await pool.acquire("second")
    await eventually(lambda: engine.in_create == 1)
    await pool.release(second.id)
    assert pool.stats()["queued_for_preparation"] == 0
    engine.creating_allowed.set()
    await pool.wait_ready(first.id, 10)
    await settle()
    assert [c.labels[LABEL_PROGRAM] for c in engine.created] == ["first"]


async def test_warm_pool_hands_out_ready_sandboxes_and_refills(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(warm=2)
    await eventually(lambda: pool.stats()["warm"] == 2)
    assert pool.stats()["warm"] == 2 and pool.sandboxes() == []  # the warm pool is not listed

    sandbox = await pool.acquire("p1")
    assert sandbox.state == "ready" and sandbox.container_id is not None
    assert pool.stats()["acquire_to_ready_s"] == {"count": 1, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    await eventually(lambda: pool.stats()["warm"] == 2)
    assert pool.stats()["warm"] == 2 and pool.stats()["bound"] == 1
    assert len(sandbox_containers(engine)) == 3
    by_state = {
        s.labels["state"]: s.value
        for s in parse_samples(render_sandbox_metrics(pool.stats()), ["thunderctl_sandboxes"])
    }
    assert by_state["warm"] == 2 and by_state["bound"] == 1

    # A warm container that died is removed and replaced at the next maintenance.
    dead = next(c for c in engine.containers.values() if c.id != sandbox.container_id)
    dead.running = False
    await pool.maintain()
    await eventually(lambda: not engine.exists(dead.id) and pool.stats()["warm"] == 2)
    assert not engine.exists(dead.id) and pool.stats()["warm"] == 2
    assert len(sandbox_containers(engine)) == 3


async def test_warm_pool_of_a_broken_image_waits_a_maintenance_interval(start_pool, engines, clock) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(warm_images={"broken:1": 1}, maintenance_interval_s=30)
    await eventually(lambda: pool.stats()["last_error"] is not None)
    assert engine.created == [] and "broken:1" in pool.stats()["last_error"]

    await pool.maintain()  # too soon: no new attempt
    await settle()
    assert pool.stats()["warm"] == 0 and pool.stats()["failed"] == 0

    engine.registry["broken:1"] = 1000  # it can be pulled now
    clock.run_until(clock.now + 30)
    await pool.maintain()
    await eventually(lambda: pool.stats()["warm"] == 1)
    assert pool.stats()["warm"] == 1 and engine.pulls == ["broken:1"]


async def test_setup_runs_before_ready_and_its_failure_is_reported(start_pool, engines) -> None:
    engine = engines[LOCAL]
    engine.commands["git clone repo"] = Command(output="fatal: no such repo\n", exit_code=7)
    pool = await start_pool()

    prepared = await ready(pool, "p1", setup="make env", env={"TOKEN": "t"})
    assert prepared.state == "ready"
    assert [(call.command, call.env) for call in engine.execs] == [("make env", {"TOKEN": "t"})]

    broken = await ready(pool, "p2", setup="git clone repo")
    assert broken.state == "failed"
    assert "exited 7" in broken.error and "no such repo" in broken.error and "git clone repo" in broken.error
    await eventually(lambda: not engine.exists(broken.container_id))  # removed right after it settles
    assert not engine.exists(broken.container_id)
    with pytest.raises(SandboxFailed, match="exited 7"):
        await pool.exec(broken.id, "true")
    assert pool.stats()["failed"] == 1


async def test_setup_past_the_prepare_timeout_fails_the_sandbox(start_pool, engines) -> None:
    engines[LOCAL].commands["pip install everything"] = Command(seconds=900)
    pool = await start_pool(prepare_timeout_s=60)
    sandbox = await ready(pool, "p1", setup="pip install everything")
    assert sandbox.state == "failed" and "timed out after 60 s" in sandbox.error


async def test_setup_of_a_warm_sandbox_runs_when_it_is_handed_out(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(warm=1)
    await eventually(lambda: pool.stats()["warm"] == 1)
    sandbox = await pool.acquire("p1", setup="checkout abc")
    assert sandbox.state == "preparing"
    assert (await pool.wait_ready(sandbox.id, 10)).state == "ready"
    assert [call.command for call in engine.execs] == ["checkout abc"]


async def test_missing_image_is_a_clear_error_and_the_pool_keeps_working(start_pool, engines) -> None:
    pool = await start_pool()
    missing = await ready(pool, "p1", image="nowhere/missing:1")
    assert missing.state == "failed" and "nowhere/missing:1" in missing.error
    assert "nowhere/missing:1" in pool.stats()["last_error"]
    assert (await ready(pool, "p1")).state == "ready"


async def test_program_end_removes_every_sandbox_of_the_program(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool()
    mine = [await ready(pool, "p1") for _ in range(3)]
    theirs = await ready(pool, "p2")

    assert await pool.program_ended("p1") == 3
    assert sandbox_containers(engine) == [theirs.container_id]
    assert pool.sandboxes() == [theirs]
    with pytest.raises(SandboxNotFound):
        pool.get(mine[0].id)


async def test_idle_sandboxes_expire_on_the_pools_clock(start_pool, engines, clock) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(idle_expiry_s=600, warm=1)
    idle = await ready(pool, "idle")
    busy = await ready(pool, "busy")
    await eventually(lambda: pool.stats()["warm"] == 1)

    clock.run_until(clock.now + 500)
    await pool.exec(busy.id, "true")
    clock.run_until(clock.now + 200)  # idle unused for 700 s, busy for 200 s
    await pool.maintain()
    await eventually(lambda: not engine.exists(idle.container_id))
    assert pool.sandboxes() == [busy] and not engine.exists(idle.container_id)
    assert pool.stats()["warm"] == 1  # the warm pool never expires


async def test_reaper_removes_orphans_of_this_cluster_and_nothing_else(start_pool, engines) -> None:
    engine = engines[LOCAL]
    orphans = [
        engine.run(IMAGE, {LABEL_CLUSTER: CLUSTER, LABEL_ROLE: "sandbox", LABEL_LEASE: "sbx-dead"}),
        engine.run(IMAGE, {LABEL_CLUSTER: CLUSTER, LABEL_LEASE: "sbx-older"}),  # before roles
    ]
    bystanders = [
        engine.run(IMAGE, {}),
        engine.run(IMAGE, {LABEL_CLUSTER: f"{CLUSTER}-other", LABEL_ROLE: "sandbox", LABEL_LEASE: "sbx-x"}),
        engine.run(IMAGE, {LABEL_CLUSTER: CLUSTER, LABEL_ROLE: ROLE_WORKER}),
        engine.run(IMAGE, {LABEL_CLUSTER: CLUSTER}),  # a worker from before roles
    ]

    pool = await start_pool()
    kept = await ready(pool, "p1")
    assert pool.stats()["reaped"] == 2
    assert not any(engine.exists(c.id) for c in orphans)
    assert all(engine.exists(c.id) for c in bystanders)
    await pool.maintain()
    assert engine.exists(kept.container_id) and pool.stats()["reaped"] == 2


def started_by_the_agent(engine: FakeEngine, clock: VirtualClock, pool: SandboxPool, program_id: str):
    """A container the program's agent started after its first request."""
    pool.program_began(program_id)
    clock.run_until(clock.now + 1)
    return engine.run(IMAGE, {})


async def test_adopted_container_is_collected_with_its_program(start_pool, engines, clock) -> None:
    engine = engines[LOCAL]
    pool = await start_pool()
    agents_own = started_by_the_agent(engine, clock, pool, "p1")

    [sandbox] = await pool.adopt("p1", [agents_own.id[:12]])
    assert sandbox.adopted and sandbox.container_id == agents_own.id and sandbox.state == "ready"
    assert await pool.adopt("p1", [agents_own.id, agents_own.id[:12]]) == [sandbox]  # the same container, once
    assert pool.stats()["adopted"] == 1

    await pool.program_ended("p1")
    assert not engine.exists(agents_own.id)
    with pytest.raises(SandboxNotFound, match="f00dfeed"):
        await pool.adopt("p1", ["f00dfeed"])


async def test_a_container_older_than_the_program_or_another_clusters_survives_adopt_and_release(
    start_pool, engines, clock
) -> None:
    engine = engines[LOCAL]
    bystander = engine.run(IMAGE, {})  # started by hand before the program
    clock.run_until(clock.now + 1)
    pool = await start_pool()
    agents_own = started_by_the_agent(engine, clock, pool, "p1")
    other_clusters = engine.run(IMAGE, {LABEL_CLUSTER: "prod", LABEL_ROLE: ROLE_WORKER})

    with pytest.raises(AdoptionRefused, match=rf"{bystander.id[:12]} was created 1.0 s before program 'p1' began"):
        await pool.adopt("p1", [agents_own.id, bystander.id])
    with pytest.raises(AdoptionRefused, match="belongs to thunderctl cluster 'prod'"):
        await pool.adopt("p1", [other_clusters.id[:12]])
    assert pool.sandboxes("p1") == []  # all or none: not even the agent's own was taken

    await pool.adopt("p1", [agents_own.id])
    await pool.program_ended("p1")
    assert engine.exists(bystander.id) and engine.exists(other_clusters.id) and not engine.exists(agents_own.id)


async def test_a_program_that_first_speaks_by_adopting_owns_nothing_older(start_pool, engines, clock) -> None:
    engine = engines[LOCAL]
    pool = await start_pool()
    older = engine.run(IMAGE, {})
    clock.run_until(clock.now + 1)
    with pytest.raises(AdoptionRefused, match="before program 'new' began"):
        await pool.adopt("new", [older.id])


@pytest.mark.parametrize("adopt", ["recent", "any"])
async def test_a_program_cannot_adopt_another_programs_live_sandbox(start_pool, engines, clock, adopt) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(adopt=adopt, warm=1)
    agents_own = started_by_the_agent(engine, clock, pool, "a")
    [adopted] = await pool.adopt("a", [agents_own.id])
    prepared = await ready(pool, "a")
    await eventually(lambda: pool.stats()["warm"] == 1, what="a warm sandbox")
    [warm] = set(sandbox_containers(engine)) - {prepared.container_id}
    pool.program_began("b")
    clock.run_until(clock.now + 1)  # b is newer than every container here: `recent` alone would let it

    app = Starlette(routes=sandbox_routes(pool))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sb") as client:
        for sandbox in (adopted, prepared):
            for docker_id in (sandbox.container_id, sandbox.container_id[:12]):
                answer = await client.post("/v1/sandboxes/adopt", json={"program_id": "b", "docker_ids": [docker_id]})
                assert answer.status_code == 403, answer.text
                assert (
                    "of program 'a': a program cannot adopt another program's sandbox"
                    in answer.json()["error"]["message"]
                )
        answer = await client.post("/v1/sandboxes/adopt", json={"program_id": "b", "docker_ids": [warm]})
        assert answer.status_code == 403 and "warm pool" in answer.json()["error"]["message"]
        assert (await client.get("/v1/sandboxes", params={"program_id": "b"})).json() == {"sandboxes": []}

    await pool.program_ended("b")
    assert all(engine.exists(c) for c in (adopted.container_id, prepared.container_id, warm))
    assert await pool.adopt("a", [adopted.container_id, prepared.container_id]) == [adopted, prepared]  # its own


async def test_adopt_any_takes_an_older_container_and_off_takes_none(start_pool, engines, clock) -> None:
    engine = engines[LOCAL]
    bystander = engine.run(IMAGE, {})
    anything = await start_pool(adopt="any")
    agents_own = started_by_the_agent(engine, clock, anything, "p1")
    [adopted] = await anything.adopt("p1", [bystander.id])
    assert adopted.container_id == bystander.id

    nothing = await start_pool(adopt="off")
    nothing.program_began("p2")
    with pytest.raises(AdoptionRefused, match=r"sandboxes.adopt: off"):
        await nothing.adopt("p2", [agents_own.id])


async def test_a_sandbox_or_worker_of_the_cluster_cannot_be_adopted(start_pool, engines, clock) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(adopt="any")
    pool.program_began("p1")
    clock.run_until(clock.now + 1)
    worker = engine.run(IMAGE, {LABEL_CLUSTER: CLUSTER, LABEL_ROLE: ROLE_WORKER})
    orphan = engine.run(IMAGE, {LABEL_CLUSTER: CLUSTER, LABEL_ROLE: "sandbox", LABEL_LEASE: "sbx-dead"})
    with pytest.raises(AdoptionRefused, match=rf"{worker.id[:12]} is this cluster's own worker"):
        await pool.adopt("p1", [worker.id[:12]])
    with pytest.raises(AdoptionRefused, match="this cluster's own sandbox, held by no live program"):
        await pool.adopt("p1", [orphan.id])
    assert engine.exists(worker.id)


async def test_restart_collects_containers_adopted_before_a_crash(start_pool, engines, clock, tmp_path) -> None:
    engine = engines[LOCAL]
    state_path = tmp_path / "sandboxes.json"
    first = await start_pool(state_path=state_path)
    agents_own = started_by_the_agent(engine, clock, first, "p1")
    await first.adopt("p1", [agents_own.id])
    # The first daemon "dies" here: only its state file is left for the next.

    second = await start_pool(state_path=state_path)
    assert not engine.exists(agents_own.id)
    assert second.stats()["reaped"] == 1


@dataclass
class LeftByACrash:
    """What a first pool's daemon left at its death: of "kept" a sandbox the pool made (with an
    env), one claimed from the warm pool (whose labels name no program) and a container its agent
    adopted; of "ended" a sandbox made; the warm pool's containers."""

    claimed: Sandbox
    made: Sandbox
    adopted: Sandbox
    ended: Sandbox
    warm: set[str]


async def restart_after_a_crash(
    start_pool, engine: FakeEngine, clock: VirtualClock, state_path: Path, removed_meanwhile: tuple[str, ...] = ()
) -> tuple[SandboxPool, LeftByACrash]:
    """The second pool, started with "kept" restored, and what the first left; the containers of
    `removed_meanwhile` (of "kept") were removed by hand between the two."""
    first = await start_pool(state_path=state_path, warm=1)
    await eventually(lambda: first.stats()["warm"] == 1)
    claimed = await first.acquire("kept")
    made = await ready(first, "kept", env={"GREETING": "hello"})
    agents_own = started_by_the_agent(engine, clock, first, "kept")
    [adopted] = await first.adopt("kept", [agents_own.id])
    ended = await ready(first, "ended")
    await eventually(lambda: first.stats()["warm"] == 1)
    bound = {claimed.container_id, made.container_id, adopted.container_id, ended.container_id}
    left = LeftByACrash(claimed, made, adopted, ended, set(sandbox_containers(engine)) - bound)
    for kind in removed_meanwhile:
        del engine.containers[getattr(left, kind).container_id]
    return await start_pool(state_path=state_path, live_programs=("kept",)), left


async def test_a_restart_binds_again_the_sandboxes_of_the_programs_that_live_on(
    start_pool, engines, clock, tmp_path
) -> None:
    engine = engines[LOCAL]
    second, left = await restart_after_a_crash(start_pool, engine, clock, tmp_path / "sandboxes.json")
    kept = (left.claimed, left.made, left.adopted)
    assert {sb.id for sb in second.sandboxes("kept")} == {sb.id for sb in kept}
    assert [sb.adopted for sb in (second.get(left.made.id), second.get(left.adopted.id))] == [False, True]
    for sandbox in kept:
        assert engine.exists(sandbox.container_id)
        assert second.get(sandbox.id).container_id == sandbox.container_id
        assert (await second.exec(sandbox.id, "true")).exit_code == 0
    assert engine.execs[-2].env == {"GREETING": "hello"}  # made's exec: its env survives too

    await second.release(left.made.id)
    await second.program_ended("kept")
    assert not any(engine.exists(sb.container_id) for sb in kept)


async def test_a_restart_reaps_the_sandboxes_of_programs_that_did_not_live_on_and_the_warm_pool(
    start_pool, engines, clock, tmp_path
) -> None:
    engine = engines[LOCAL]
    second, left = await restart_after_a_crash(start_pool, engine, clock, tmp_path / "sandboxes.json")
    assert not engine.exists(left.ended.container_id) and not any(engine.exists(c) for c in left.warm)
    with pytest.raises(SandboxNotFound):
        second.get(left.ended.id)
    assert second.stats()["reaped"] == 2  # "ended"'s and the warm one


async def test_a_restart_forgets_a_bound_sandbox_whose_container_is_gone(start_pool, engines, clock, tmp_path) -> None:
    second, left = await restart_after_a_crash(
        start_pool, engines[LOCAL], clock, tmp_path / "sandboxes.json", removed_meanwhile=("made", "adopted")
    )
    assert {sb.id for sb in second.sandboxes("kept")} == {left.claimed.id}


async def test_what_docker_did_not_remove_at_shutdown_is_named_by_the_sweep_and_removed_once_it_answers(
    start_pool, engines, clock, tmp_path
) -> None:
    engine = engines[LOCAL]
    state_path = tmp_path / "sandboxes.json"
    pool = await start_pool(state_path=state_path)
    prepared = await ready(pool, "p1")
    agents_own = started_by_the_agent(engine, clock, pool, "p1")
    await pool.adopt("p1", [agents_own.id])
    engine.answering = False
    await pool.maintain()  # the pool sees Docker gone
    await pool.shutdown()  # the daemon's at `down`: it cannot remove either container
    assert engine.exists(prepared.container_id) and engine.exists(agents_own.id)

    def sweeper() -> SandboxPool:  # `down`'s, once the daemon has exited: a pool that is never started
        config = SandboxConfig(image=IMAGE, hosts=[LOCAL])
        return SandboxPool(config, CLUSTER, state_path, host_factory=fake_hosts(engines), clock=clock, wall_clock=clock)

    silent = await sweeper().sweep()
    assert silent.removed == 0
    assert silent.left == [
        f"no Docker engine answers at {LOCAL}: connection refused",
        f"container {agents_own.id[:12]} adopted on {LOCAL}",  # no label of ours: only the state file knows it
    ]
    engine.answering = True
    answered = await sweeper().sweep()
    assert (answered.removed, answered.left) == (2, [])
    assert not engine.exists(prepared.container_id) and not engine.exists(agents_own.id)


async def test_unavailable_hosts_are_named_and_the_other_host_serves(start_pool, engines) -> None:
    engines[OTHER].answering = False
    alone = await start_pool(hosts=[OTHER], warm=2)
    stats = alone.stats()
    assert not stats["available"] and OTHER in stats["reason"]
    with pytest.raises(PoolUnavailable, match=OTHER):
        await alone.acquire("p1")
    await alone.maintain()  # the periodic round survives a host that does not answer

    pair = await start_pool(hosts=[OTHER, LOCAL])
    sandbox = await ready(pair, "p1")
    assert sandbox.host.url == LOCAL and pair.stats()["hosts"][0]["available"] is False

    engines[OTHER].answering = True
    await alone.maintain()
    await eventually(lambda: alone.stats()["warm"] == 2)
    assert alone.stats()["available"] and alone.stats()["warm"] == 2


async def test_sandboxes_spread_over_the_hosts(start_pool, engines) -> None:
    pool = await start_pool(hosts=[LOCAL, OTHER])
    sandboxes = [await ready(pool, f"p{n}") for n in range(4)]
    assert sorted(sb.host.url for sb in sandboxes) == sorted([LOCAL, LOCAL, OTHER, OTHER])
    assert [h["sandboxes"] for h in pool.stats()["hosts"]] == [2, 2]


async def test_disabled_pool_refuses_and_touches_no_engine(start_pool, engines) -> None:
    pool = await start_pool(enabled=False, warm=2)
    with pytest.raises(PoolUnavailable, match="disabled"):
        await pool.acquire("p1")
    assert pool.stats()["reason"] == "disabled in the profile" and engines[LOCAL].created == []


async def test_disk_above_watermark_evicts_pulled_images_no_container_uses(start_pool, engines) -> None:
    engine = engines[LOCAL]
    engine.registry |= {"old:1": 3000, "newer:1": 3000, "in-use:1": 3000}
    pool = await start_pool(disk_high_watermark="6k")
    for program_id, image in [("p-old", "old:1"), ("p-newer", "newer:1"), ("p-in-use", "in-use:1")]:
        assert (await ready(pool, program_id, image=image)).state == "ready"
    await pool.program_ended("p-old")
    await pool.program_ended("p-newer")

    # 9000 bytes pulled, over 6144: the least recently used image no container uses goes, and
    # that is enough. The one in use and the image the pool did not pull are never candidates.
    await pool.maintain()
    stats = pool.stats()
    assert stats["evicted_images"] == 1 and stats["disk_bytes"] == 6000
    assert set(engine.images) == {IMAGE, "newer:1", "in-use:1"}
    await pool.maintain()  # under the watermark now: nothing more goes
    assert pool.stats()["evicted_images"] == 1


async def test_the_disk_figure_says_how_old_it_is_on_the_pools_clock(start_pool, clock) -> None:
    pool = await start_pool()
    await pool.maintain()
    assert pool.stats()["hosts"][0]["disk_age_s"] == 0
    clock.run_until(clock.now + 4)
    assert pool.stats()["hosts"][0]["disk_age_s"] == 4  # the reader knows the figure is 4 s old
    await pool.maintain()
    assert pool.stats()["hosts"][0]["disk_age_s"] == 0


async def test_image_named_in_a_request_is_pulled_and_recorded(start_pool, engines, tmp_path) -> None:
    engine = engines[LOCAL]
    engine.registry["tools:2"] = 1000
    state_path = tmp_path / "sandboxes.json"
    pool = await start_pool(state_path=state_path)
    await ready(pool, "p1", image="tools:2")
    await ready(pool, "p2", image="tools:2")
    assert engine.pulls == ["tools:2"]  # pulled once, then present
    assert '"tools:2"' in state_path.read_text()  # remembered across restarts, for eviction


async def test_shutdown_removes_every_container_of_the_pool(start_pool, engines) -> None:
    engine = engines[LOCAL]
    pool = await start_pool(warm=2)
    await ready(pool, "p1")
    await eventually(lambda: len(sandbox_containers(engine)) == 3)
    assert len(sandbox_containers(engine)) == 3
    await pool.shutdown()
    assert sandbox_containers(engine) == []
