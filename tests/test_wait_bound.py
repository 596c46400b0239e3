"""The wait bound: a request that waited `wait_bound_s` gets room, ACTING programs pausing for it."""

from __future__ import annotations

from thunderctl.scheduler import Scheduler, SchedulerConfig, Status


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def waited_for_room(wait_bound_s: float | None) -> float:
    """A worker full of ACTING programs that keep returning; four programs wait 20 s each for a
    release, then one asks while nothing is released: how long it waits for room."""
    clock = FakeClock()
    # No continuation gap is ever learnt: the held programs would look ended and give up their room
    # before the bound, which is what this measures.
    config = SchedulerConfig(
        adaptive={"enabled": False},
        retention={"enabled": False, "tool_time_min_samples": 10_000},
        admission={"buffer_tokens": 0},
        waits={"forced_resume_s": 600, "new_program_delay_s": 0, "bound_s": wait_bound_s},
        ending={"unlearnt_s": 10_000},
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


def test_a_waiter_gets_room_at_the_bound_though_others_waited_far_less() -> None:
    assert 400 <= waited_for_room(400.0) <= 406


def test_without_a_bound_the_waiter_waits_for_its_forced_resume() -> None:
    assert 600 <= waited_for_room(None) <= 606
