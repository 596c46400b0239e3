"""A host KV tier as the scheduler counts it: two levels, on a fake clock (no I/O anywhere).

What decodes (REASONING programs) must fit the GPU's cache; the KV of ACTING programs may
spill to the host tier, bounded by GPU + host; a paused program's KV is expected there, so
its return is priced as a transfer and it resumes where that host tier is.
"""

from __future__ import annotations

import pytest

from thunderctl.scheduler import EventKind, Phase, ProgramEvent, Scheduler, SchedulerConfig, Status
from thunderctl.sim.clock import VirtualClock

GPU = 1000
# Round numbers: the GPU holds 1000 tokens, resume band 900, pause band 950; no buffer.
BANDS = {
    "admission.pause_threshold": 0.95, "admission.pause_target": 0.8, "admission.resume_threshold": 0.9,
    "admission.buffer_tokens": 0, "waits.forced_resume_s": 600, "waits.bound_s": None, "ending.floor_s": 3000,
    "adaptive.enabled": False, "retention.enabled": False,
}  # fmt: skip


def make(host: int, workers: tuple[str, ...] = ("a",), **overrides) -> tuple[Scheduler, list[ProgramEvent]]:
    events: list[ProgramEvent] = []
    sched = Scheduler(SchedulerConfig(**(BANDS | overrides)), VirtualClock(1000.0), [events.append])
    for worker_id in workers:
        sched.add_worker(worker_id, GPU, host)
    return sched, events


def acting(sched: Scheduler, program_id: str, tokens: int) -> None:
    """An admitted program whose response is out: it ACTs, its KV kept."""
    assert sched.on_request(program_id, tokens) is not None
    sched.on_response(program_id, tokens, 0)


@pytest.mark.parametrize("host", [4 * GPU, 100 * GPU])
def test_a_decoding_set_bigger_than_the_gpu_is_not_admitted_even_with_host_room(host: int) -> None:
    sched, _ = make(host)
    assert sched.on_request("p1", 400) == "a"
    assert sched.on_request("p2", 400) == "a"
    assert sched.on_request("p3", 400) is None  # 1200 would decode on a GPU of 1000
    assert sched.programs["p3"].status is Status.PAUSED
    sched.on_response("p1", 400, 0)  # p1 decodes no more: its KV may spill to the host
    assert sched.programs["p3"].status is Status.ACTIVE


@pytest.mark.parametrize(
    ("host", "admitted"),
    [
        (0, False),  # one level: ACTING KV keeps its room on the GPU
        (4 * GPU, True),  # it spills to the host; only the newcomer decodes
    ],
)
def test_acting_kv_spills_to_the_host_tier(host: int, admitted: bool) -> None:
    sched, _ = make(host)
    acting(sched, "p1", 400)
    acting(sched, "p2", 400)
    assert (sched.on_request("p3", 400) == "a") is admitted


def test_acting_kv_is_bounded_by_gpu_plus_host() -> None:
    sched, _ = make(GPU)  # 2000 in all, resume band 1800
    for index in range(4):
        acting(sched, f"p{index}", 400)
    assert sched.on_request("late", 400) is None  # 2000 > 1800, though nothing else decodes


def test_an_admitted_program_waits_while_its_decode_would_overfill_the_gpu() -> None:
    sched, events = make(4 * GPU)
    for program_id in ("p1", "p2", "p3"):
        acting(sched, program_id, 400)
    assert sched.on_request("p1", 400) == "a"
    assert sched.on_request("p2", 400) == "a"
    assert sched.on_request("p3", 400) is None  # 1200 > 950 would decode: it waits, KV in the host
    assert sched.counters.gpu_waits == 1
    sched.on_response("p1", 400, 0)
    assert [e.kind for e in events if e.program.id == "p3"][-2:] == [EventKind.PAUSED, EventKind.RESUMED]
    assert sched.programs["p3"].worker == "a"


def test_a_program_decoding_alone_is_admitted_whatever_its_size() -> None:
    sched, _ = make(4 * GPU)
    acting(sched, "big", 1500)  # more than the GPU: the engine takes it alone, as without a tier
    assert sched.on_request("big", 1500) == "a"


@pytest.mark.parametrize("host", [0, 4 * GPU])
def test_without_decoders_an_admitted_program_returns_at_once(host: int) -> None:
    sched, _ = make(host)
    acting(sched, "p1", 800)
    acting(sched, "p2", 50)
    assert sched.on_request("p1", 800) == "a"
    assert sched.on_request("p2", 50) == "a"  # 850 decode, under the pause band


def decoding_on(sched: Scheduler, worker_id: str) -> list[str]:
    return [i for i in sched.workers[worker_id].programs if sched.programs[i].phase is Phase.REASONING]


def test_a_paused_program_resumes_where_its_host_tier_keeps_its_kv() -> None:
    sched, _ = make(4 * GPU, workers=("a", "b"))
    acting(sched, "p", 400)
    home = sched.programs["p"].worker
    other = "b" if home == "a" else "a"
    index = 0
    while sched.on_request(f"d{index}", 300) is not None:  # both GPUs fill with decodes
        index += 1
    sched.release(f"d{index}")
    assert sched.on_request("p", 400) is None
    for program_id in decoding_on(sched, other):
        sched.on_response(program_id, 300, 0)
    assert sched.programs["p"].status is Status.PAUSED  # room elsewhere, where it would re-prefill
    for program_id in decoding_on(sched, home):
        sched.on_response(program_id, 300, 0)
    assert sched.programs["p"].status is Status.ACTIVE
    assert sched.programs["p"].worker == home


HOLDER = 20_000


def priced(gpu: int, host: int, transfer_tokens_per_s: float, tool_s: float) -> tuple[Scheduler, VirtualClock]:
    """Priced retention on one worker, its tools learnt to last `tool_s`; re-prefill at 10k tokens/s."""
    clock = VirtualClock(1000.0)
    config = SchedulerConfig(
        **BANDS | {
            "retention.enabled": True, "retention.prefill_tokens_per_s": 10_000.0,
            "retention.host_transfer_tokens_per_s": transfer_tokens_per_s, "retention.tool_time_min_samples": 8,
        },
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", gpu, host)
    for _ in range(20):
        assert sched.on_request("trainer", 10) == "a"
        sched.on_response("trainer", 10, 0)
        clock.now += tool_s
    sched.release("trainer")
    return sched, clock


@pytest.mark.parametrize(
    ("gpu", "host", "transfer_tokens_per_s", "dropped"),
    [
        # keep = 20k × 5 s ÷ 200k = 0.5 engine-s against a 2 s re-prefill: kept
        (200_000, 0, 500_000.0, 0),
        # the same KV in a host tier comes back in 0.04 s: dropped, two for the 40k that wait
        (100_000, 100_000, 500_000.0, 2),
        # a host link slower than the prefill (4 s): kept
        (100_000, 100_000, 5_000.0, 0),
    ],
)
def test_a_host_resident_return_is_priced_as_a_transfer(
    gpu: int, host: int, transfer_tokens_per_s: float, dropped: int
) -> None:
    sched, clock = priced(gpu, host, transfer_tokens_per_s, tool_s=5.0)
    for index in range(8):
        acting(sched, f"h{index}", HOLDER)  # 160k of the 180k band, all ACTING
    assert sched.on_request("waiter", 40_000) is None
    clock.now += 0.5
    sched.tick()
    assert sched.counters.priced_pauses == dropped
    assert (sched.programs["waiter"].status is Status.ACTIVE) is bool(dropped)


def test_host_resident_kv_is_not_dropped_while_the_gpu_is_what_keeps_the_queue_out() -> None:
    sched, clock = priced(100_000, 400_000, 500_000.0, tool_s=40.0)
    for index in range(4):
        acting(sched, f"h{index}", HOLDER)
    for index in range(4):
        assert sched.on_request(f"d{index}", HOLDER) == "a"  # 80k decoding
    assert sched.on_request("waiter", HOLDER) is None  # 100k would decode; 180k of 450k in all
    for _ in range(5):
        clock.now += 1
        sched.tick()
    assert sched.counters.priced_pauses == 0  # dropping ACTING KV would free host room, not GPU
