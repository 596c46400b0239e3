"""Placement: a program goes where its KV is (new, where its shared prefix is) while nobody else waits for
room, else to the most headroom."""

from __future__ import annotations

import zlib

import pytest

from thunderctl.scheduler import PlacementRule, Scheduler, SchedulerConfig, Status
from thunderctl.scheduler.placement import home
from thunderctl.sim.clock import VirtualClock

BACKENDS = ("a", "b")


def make(placement: PlacementRule = PlacementRule.AFFINITY) -> Scheduler:
    """Two workers of 1,000 tokens, admission up to 900; no buffer, no admission law."""
    config = SchedulerConfig(
        placement=placement,
        adaptive={"enabled": False},
        retention={"enabled": False},
        admission={"buffer_tokens": 0, "pause_threshold": 0.95, "pause_target": 0.8, "resume_threshold": 0.9},
    )  # fmt: skip
    sched = Scheduler(config, VirtualClock(1000.0))
    for worker_id in BACKENDS:
        sched.add_worker(worker_id, 1000)
    return sched


def homed_on(worker_id: str, count: int = 1, prefix: str = "p") -> list[str]:
    """Program ids whose CRC-32 modulo 2 names `backend_id`, as a hash-pinning client routes them."""
    index = BACKENDS.index(worker_id)
    ids = (f"{prefix}{i}" for i in range(10_000))
    return [pid for pid in ids if zlib.crc32(pid.encode()) % len(BACKENDS) == index][:count]


def load(sched: Scheduler, worker_id: str, tokens: int) -> None:
    """A decoding program of `tokens` on `backend_id` (placed there while the other is out)."""
    others = [b for b in sched.workers.values() if b.id != worker_id]
    for worker in others:
        worker.schedulable = False
    assert sched.on_request(f"load_{worker_id}", tokens) == worker_id
    for worker in others:
        worker.schedulable = True


def test_home_is_the_hash_a_pinning_client_uses() -> None:
    for worker_id in BACKENDS:
        for pid in homed_on(worker_id, count=20):
            assert home(pid, BACKENDS) == worker_id


@pytest.mark.parametrize(
    ("home_backend", "loads"),
    [
        ("a", {"a": 0, "b": 0}),
        ("b", {"a": 0, "b": 0}),
        # its home is the fuller worker but has room: it still goes home
        ("a", {"a": 600, "b": 100}),
        ("b", {"a": 0, "b": 800}),
    ],
)
def test_a_new_program_goes_to_its_hash_home_when_it_fits(home_backend, loads) -> None:
    sched = make()
    for worker_id, tokens in loads.items():
        if tokens:
            load(sched, worker_id, tokens)
    (pid,) = homed_on(home_backend)
    assert sched.on_request(pid, 50) == home_backend


@pytest.mark.parametrize(
    ("home_backend", "loads", "placed"),
    [
        # 880 + 50 is over the 900 band at home: the other worker takes it
        ("a", {"a": 880, "b": 100}, "b"),
        ("b", {"a": 300, "b": 860}, "a"),
    ],
)
def test_a_new_program_whose_home_is_full_goes_to_the_most_headroom(home_backend, loads, placed) -> None:
    sched = make()
    for worker_id, tokens in loads.items():
        load(sched, worker_id, tokens)
    (pid,) = homed_on(home_backend)
    assert sched.on_request(pid, 50) == placed


@pytest.mark.parametrize(("ran_on", "other"), [("a", "b"), ("b", "a")])
def test_a_paused_program_returns_to_the_backend_it_ran_on_when_it_fits(ran_on, other) -> None:
    sched = make()
    (pid,) = homed_on(other)  # its hash says the other worker: where it ran wins
    load(sched, ran_on, 500)
    sched.workers[other].schedulable = False
    assert sched.on_request(pid, 200) == ran_on
    sched.on_response(pid, 200, 0)
    sched.workers[other].schedulable = True
    sched.drain(ran_on)  # it pauses ACTING; nothing new goes there until undrained
    assert sched.programs[pid].status is Status.PAUSED
    sched.set_schedulable(ran_on, True)
    assert sched.on_request(pid, 220) == ran_on  # although the other worker is empty


@pytest.mark.parametrize(("home_backend", "roomier"), [("a", "b"), ("b", "a")])
def test_while_another_program_waits_a_program_goes_to_the_most_headroom(home_backend, roomier) -> None:
    sched = make()
    load(sched, home_backend, 500)  # room 400 at home, 600 on the other
    load(sched, roomier, 300)
    assert sched.on_request("huge", 650) is None  # fits neither worker: it waits
    (pid,) = homed_on(home_backend)
    # ahead of huge in the queue (shorter), admitted while huge still waits: the room decides
    assert sched.on_request(pid, 100) == roomier
    assert sched.programs["huge"].status is Status.PAUSED


@pytest.mark.parametrize("home_backend", BACKENDS)
def test_the_reference_rule_places_a_new_program_on_the_most_headroom(home_backend) -> None:
    sched = make(PlacementRule.ROOMIEST)
    roomier = "b" if home_backend == "a" else "a"
    load(sched, home_backend, 200)
    (pid,) = homed_on(home_backend)
    assert sched.on_request(pid, 50) == roomier


def prefixed(sched: Scheduler, worker_id: str, tokens: int, prefix: str = "system") -> None:
    """A decoding program of `tokens` on `worker_id` whose first 100 are the shared `prefix`."""
    others = [b for b in sched.workers.values() if b.id != worker_id]
    for worker in others:
        worker.schedulable = False
    assert sched.on_request(f"{prefix}_{worker_id}", tokens, prefix_key=prefix, prefix_tokens=100) == worker_id
    for worker in others:
        worker.schedulable = True


@pytest.mark.parametrize(("cached_on", "other"), [("a", "b"), ("b", "a")])
def test_a_new_program_goes_where_its_prefix_is_cached_not_to_its_hash_home(cached_on, other) -> None:
    sched = make()
    prefixed(sched, cached_on, 300)
    load(sched, other, 400)  # p's hash home, with room for it
    (pid,) = homed_on(other)
    assert sched.on_request(pid, 150, prefix_key="system", prefix_tokens=100) == cached_on


@pytest.mark.parametrize(("cached_on", "other"), [("a", "b"), ("b", "a")])
def test_a_new_program_whose_prefix_worker_carries_more_than_its_share_goes_to_its_hash_home(cached_on, other) -> None:
    sched = make()
    prefixed(sched, cached_on, 400)  # the other worker is idle: the prefix would pile everything up here
    (pid,) = homed_on(other)
    assert sched.on_request(pid, 150, prefix_key="system", prefix_tokens=100) == other


def test_a_new_program_of_another_prefix_goes_to_its_hash_home() -> None:
    sched = make()
    prefixed(sched, "a", 300)
    load(sched, "b", 400)
    (pid,) = homed_on("b")
    assert sched.on_request(pid, 150, prefix_key="other", prefix_tokens=100) == "b"
