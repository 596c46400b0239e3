"""Bounded waits: the resume order is aged, so no program waits behind an endless stream of shorter ones."""

from __future__ import annotations

from thunderctl.scheduler import Scheduler, SchedulerConfig, Status
from thunderctl.sim.clock import VirtualClock

SMALL, LARGE, HOG = 50, 450, 400  # admission up to 900 of 1000: the large fits only without smalls
SMALL_STEP_S = 3  # a small program's one request, then its end
LARGE_ASKS_AT = 5


def run(aging_tokens_per_s: float | None, seconds: int = 120) -> tuple[float | None, dict[str, tuple[float, float]]]:
    """A hog decodes throughout; a small program asks every second and runs 3 s; a large one
    asks at 5 s. Returns when the large one was admitted, and every small's (asked, admitted)."""
    clock = VirtualClock()
    config = SchedulerConfig(
        adaptive={"enabled": False},
        retention={"enabled": False},
        admission={"buffer_tokens": 0},
        waits={"forced_resume_s": 10_000, "aging_tokens_per_s": aging_tokens_per_s, "new_program_delay_s": 0},
        ending={"floor_s": 10_000},
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", 1000)
    assert sched.on_request("hog", HOG) == "a"
    smalls: dict[str, tuple[float, float]] = {}
    asked: dict[str, float] = {}
    large_admitted = None
    for second in range(seconds):
        clock.now = float(second)
        for pid, (_, at) in smalls.items():
            if at + SMALL_STEP_S == second:
                sched.on_response(pid, SMALL, 0)
                sched.release(pid)
        if second == LARGE_ASKS_AT:
            sched.on_request("large", LARGE)
        asked[f"small-{second}"] = clock.now
        sched.on_request(f"small-{second}", SMALL)
        sched.tick()
        for pid, program in sched.programs.items():
            if pid.startswith("small") and program.status is Status.ACTIVE and pid not in smalls:
                smalls[pid] = (asked[pid], clock.now)
        if large_admitted is None and "large" in sched.programs and sched.programs["large"].status is Status.ACTIVE:
            large_admitted = clock.now
    return large_admitted, smalls


def test_a_large_program_is_overtaken_only_by_programs_that_asked_within_its_aging_bound() -> None:
    rate = 100.0  # tokens per second of head start: the large one is behind smalls for 4.5 s
    bound = LARGE / rate - SMALL / rate  # a small asking later than this after it queues behind it
    admitted, smalls = run(rate)
    assert admitted is not None
    overtook = [pid for pid, (asked, at) in smalls.items() if at < admitted and asked > LARGE_ASKS_AT]
    assert overtook, "the smalls that asked just after it go first: shorter first within the bound"
    assert all(smalls[pid][0] - LARGE_ASKS_AT <= bound for pid in overtook), overtook
    # Once it heads the queue, the smalls running finish and free its room.
    assert admitted - LARGE_ASKS_AT <= LARGE / rate + SMALL_STEP_S + 1


def test_without_aging_a_stream_of_shorter_programs_starves_a_large_one() -> None:
    admitted, smalls = run(aging_tokens_per_s=None)  # shortest first, as the reference orders
    assert admitted is None
    assert len(smalls) > 100  # while the smalls all went


def test_a_program_at_its_wait_bound_is_admitted_at_once_acting_programs_pausing_for_it() -> None:
    """A full worker of ACTING programs that keep returning, and one that asks while it is full:
    it waits no longer than the bound (not until the forced resume), and the ACTING program
    longest in its tool is the one that makes room."""
    clock = VirtualClock()
    config = SchedulerConfig(
        adaptive={"enabled": False},
        # no tool times trusted: held-0 is not taken for ended (scheduler.md, Ending)
        retention={"enabled": False, "tool_time_min_samples": 10_000},
        admission={"buffer_tokens": 0},
        waits={"forced_resume_s": 600, "bound_s": 100, "new_program_delay_s": 0},
        ending={"floor_s": 10_000},
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", 1000)
    for index in range(3):  # 900 of 1000: the resume band is full
        clock.now = float(index)
        sched.on_request(f"held-{index}", 300)
        sched.on_response(f"held-{index}", 300, 0)
    clock.now = 10.0
    assert sched.on_request("waiter", 200) is None
    admitted = None
    for second in range(11, 300):
        clock.now = float(second)
        for index in (1, 2):  # these two return every few seconds; held-0 stays in its tool
            if second % 5 == index and sched.programs[f"held-{index}"].status is Status.ACTIVE:
                sched.on_request(f"held-{index}", 300)
                sched.on_response(f"held-{index}", 300, 0)
        sched.tick()
        if sched.programs["waiter"].status is Status.ACTIVE:
            admitted = clock.now
            break
    assert admitted is not None and admitted - 10.0 <= config.waits.bound_s + config.tick_interval_s
    assert sched.counters.forced_resumes == 0
    assert sched.programs["held-0"].status is Status.PAUSED, "the program longest in its tool made the room"
    assert sched.programs["held-1"].status is Status.ACTIVE and sched.programs["held-2"].status is Status.ACTIVE
    assert sched.counters.bound_pauses == 1


def test_without_a_wait_bound_only_the_forced_resume_ends_the_wait() -> None:
    clock = VirtualClock()
    config = SchedulerConfig(
        **{
            "adaptive.enabled": False,
            "retention.enabled": False,
            "admission.buffer_tokens": 0,
            "waits.forced_resume_s": 200,
            "ending.floor_s": 10_000,
            "waits.bound_s": None,
        }
    )
    sched = Scheduler(config, clock)
    sched.add_worker("a", 1000)
    for index in range(3):
        sched.on_request(f"held-{index}", 300)
        sched.on_response(f"held-{index}", 300, 0)
    assert sched.on_request("waiter", 200) is None
    for second in range(1, 199):
        clock.now = float(second)
        sched.tick()
    assert sched.programs["waiter"].status is Status.PAUSED
    clock.now = 201.0
    sched.tick()
    assert sched.programs["waiter"].status is Status.ACTIVE and sched.counters.forced_resumes == 1
