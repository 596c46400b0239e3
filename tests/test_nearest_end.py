"""Nearest the end first (progress.py): of two waiting programs of one size, the one expected to
have fewer steps left resumes first, and none waits more than `nearest_end_s` behind another."""

from __future__ import annotations

import pytest

from thunderctl.scheduler import Scheduler, SchedulerConfig, Status
from thunderctl.scheduler.progress import ProgramLengths
from thunderctl.sim.clock import VirtualClock

LENGTH = 10  # steps of every program that ended before
SIZE = 500  # tokens of each of the two: only one fits beside nothing else in the 900-token band
HOG = 900


def run_steps(sched: Scheduler, program_id: str, steps: int, tokens: int) -> None:
    for _ in range(steps):
        sched.on_request(program_id, tokens)
        sched.on_response(program_id, tokens, 0)


def first_resumed(nearest_end_s: float | None, old_asks_after_s: float) -> str:
    """Programs of LENGTH steps ended; `young` has run 1 step and `old` 8, both paused; a hog
    fills the worker; `young` asks at 10 s, `old` `old_asks_after_s` later; the hog ends.
    Returns which of the two the room went to."""
    clock = VirtualClock()
    config = SchedulerConfig(
        adaptive={"enabled": False},
        retention={"enabled": False, "tool_time_min_samples": 10_000},
        admission={"buffer_tokens": 0},
        waits={"forced_resume_s": 10_000, "bound_s": None, "new_program_delay_s": 0, "nearest_end_s": nearest_end_s, "nearest_end_min_samples": 4},
        ending={"floor_s": 10_000, "unlearnt_s": 10_000},
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", 1000)
    for index in range(4):
        run_steps(sched, f"done-{index}", LENGTH, 100)
        sched.release(f"done-{index}")
    for program_id, steps in (("young", 1), ("old", 8)):
        run_steps(sched, program_id, steps, SIZE)
        sched.forget_cached_contexts()  # paused: its next request waits for room
    assert sched.on_request("hog", HOG) == "a"
    clock.now = 10.0
    assert sched.on_request("young", SIZE) is None
    clock.now = 10.0 + old_asks_after_s
    assert sched.on_request("old", SIZE) is None
    sched.on_response("hog", HOG, 0)
    sched.release("hog")
    active = [pid for pid in ("young", "old") if sched.programs[pid].status is Status.ACTIVE]
    assert len(active) == 1, active
    return active[0]


def test_a_program_near_its_end_resumes_before_one_just_begun_of_the_same_size() -> None:
    assert first_resumed(nearest_end_s=300, old_asks_after_s=1) == "old"


def test_without_the_law_the_one_that_asked_first_resumes_first() -> None:
    assert first_resumed(nearest_end_s=None, old_asks_after_s=1) == "young"


def test_a_program_just_begun_is_overtaken_by_none_that_asked_more_than_the_span_after_it() -> None:
    # young's share left is 0.9 and old's 0.2: old is ahead of it by 0.7 × 300 = 210 s at most.
    assert first_resumed(nearest_end_s=300, old_asks_after_s=200) == "old"
    assert first_resumed(nearest_end_s=300, old_asks_after_s=220) == "young"


def test_the_steps_left_are_those_of_the_programs_that_ran_longer() -> None:
    lengths = ProgramLengths(SchedulerConfig(**{"waits.nearest_end_min_samples": 4, "waits.nearest_end_window": 4}))
    for steps in (2, 4, 6, 8, 20):  # the oldest (2) leaves the window of 4
        lengths.observe(steps)
    fresh = (4 + 6 + 8 + 20) / 4
    assert lengths.remaining_share(5) == pytest.approx(((6 + 8 + 20) / 3 - 5) / fresh)
    assert lengths.remaining_share(20) == 0.0  # as old as the oldest: at its end


def test_programs_still_running_count_as_at_least_as_long_as_they_are_so_far() -> None:
    lengths = ProgramLengths(SchedulerConfig(**{"waits.nearest_end_min_samples": 2}))
    lengths.observe(4)
    assert lengths.remaining_share(2) is None  # one program seen: too few
    lengths.survey([12, 0])  # one running after 12 steps (one not started is no evidence)
    # Half ended at 4, half run to 13 at least: from 2 steps in, 4 − 2 or 13 − 2 left.
    assert lengths.remaining_share(2) == pytest.approx((0.5 * 2 + 0.5 * 11) / (0.5 * 4 + 0.5 * 13))
