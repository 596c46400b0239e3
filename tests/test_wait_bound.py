"""The wait bound follows the waits programs see: a multiple of their median, between a floor and a ceiling."""

from __future__ import annotations

import pytest

from thunderctl.scheduler import Scheduler, SchedulerConfig, Status
from thunderctl.scheduler.waitbound import WaitBound

LAW = dict(wait_bound_s=400.0, wait_bound_factor=3.0, wait_bound_min_s=60.0, wait_bound_min_samples=4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("overrides", "waits", "bound"),
    [
        ({}, [50, 50, 50], 400.0),  # too few waits to trust: the ceiling
        ({}, [40, 50, 60, 70], 165.0),  # 3 × the median (55)
        ({}, [0, 0, 0, 0, 50, 50, 50, 50], 150.0),  # requests admitted at once are not waits
        ({}, [5, 10, 10, 20], 60.0),  # short waits: the floor, not 30 s
        ({}, [100, 200, 300, 400], 400.0),  # long waits: the ceiling
        ({"wait_bound_factor": None}, [10, 10, 10, 10], 400.0),  # the fixed bound
        ({"wait_bound_s": None}, [10, 10, 10, 10], None),  # no bound at all
        ({"wait_bound_window": 4}, [300, 300, 300, 300, 20, 20, 20, 20], 60.0),  # only the recent waits count
        ({"wait_bound_s": 50.0}, [5, 10, 10, 20], 50.0),  # a ceiling under the floor: the ceiling
    ],
)
def test_the_bound_is_a_multiple_of_the_median_wait_between_floor_and_ceiling(
    overrides: dict, waits: list[float], bound: float | None
) -> None:
    law = WaitBound(SchedulerConfig(**(LAW | overrides)))
    for wait in waits:
        law.observe(wait)
    assert law.seconds == bound


def waited_for_room(factor: float | None) -> float:
    """A worker full of ACTING programs that keep returning; four programs wait 20 s each for a
    release, then one asks while nothing is released: how long it waits for room."""
    clock = FakeClock()
    # No continuation gap is ever learnt: the held programs would look ended and give up their room
    # before the bound, which is what this measures.
    config = SchedulerConfig(
        adaptive=False, retention=False, buffer_tokens=0, resume_timeout_s=600, end_unlearnt_s=10_000, tool_time_min_samples=10_000,
        new_program_delay_s=0, **(LAW | {"wait_bound_factor": factor}),
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", 1000)

    def step(program_id: str, tokens: int) -> None:
        sched.on_request(program_id, tokens)
        sched.on_response(program_id, tokens, 0)

    for index in range(3):  # 900 of 1000: the resume band is full
        step(f"held-{index}", 300)
    for index in range(4):  # each waits 20 s for held-2's room, then ends and gives it back
        assert sched.on_request(f"short-{index}", 300) is None
        clock.now += 20
        sched.release("held-2")
        assert sched.programs[f"short-{index}"].status is Status.ACTIVE
        sched.on_response(f"short-{index}", 300, 0)
        sched.release(f"short-{index}")
        step("held-2", 300)
    asked = clock.now
    assert sched.on_request("waiter", 200) is None
    while sched.programs["waiter"].status is not Status.ACTIVE:
        clock.now += 1
        if int(clock.now) % 5 == 0:  # held-1 and held-2 return; held-0 stays in its tool
            step("held-1", 300)
            step("held-2", 300)
        sched.tick()
        assert clock.now - asked < 1000, "never admitted"
    return clock.now - asked


@pytest.mark.parametrize(("factor", "low", "high"), [(3.0, 60, 66), (None, 400, 406)])
def test_a_waiter_gets_room_at_a_multiple_of_what_others_waited_not_at_a_fixed_400_s(
    factor: float | None, low: float, high: float
) -> None:
    assert low <= waited_for_room(factor) <= high
