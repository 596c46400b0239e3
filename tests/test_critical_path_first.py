"""The critical path first (critical.py): in a batch, the program with the most work left resumes
first, pauses last and keeps its KV under priced retention; outside a batch nothing changes."""

from __future__ import annotations

from thunderctl.scheduler import Scheduler, SchedulerConfig, Status
from thunderctl.scheduler.groups import GroupBook
from thunderctl.scheduler.progress import steps_left
from thunderctl.sim.clock import VirtualClock

SIZE = 500  # tokens of each of the two compared: only one fits beside nothing else in the 900-token band
HOG = 900
LONG, SHORT = 20, 2  # steps of the sample of each task that ended


def batch(critical_path: bool, retention: bool = False) -> tuple[Scheduler, VirtualClock]:
    """A worker of 1,000 tokens; a sample of task `long` ended after LONG steps and one of `short`
    after SHORT, each a second a step."""
    clock = VirtualClock(1000.0)
    config = SchedulerConfig(
        adaptive={"enabled": False},
        retention={"enabled": retention, "prefill_tokens_per_s": 100.0, "tool_time_min_samples": 4},
        admission={"buffer_tokens": 0},
        waits={"forced_resume_s": 10_000, "bound_s": None, "new_program_delay_s": 0, "critical_path": critical_path},
        ending={"floor_s": 10_000, "unlearnt_s": 10_000},
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", 1000)
    for group, steps in (("long", LONG), ("short", SHORT)):
        run_steps(sched, clock, f"{group}-done", steps, 100, group)
        sched.release(f"{group}-done")
    return sched, clock


def run_steps(sched: Scheduler, clock: VirtualClock, program_id: str, steps: int, tokens: int, group: str) -> None:
    for _ in range(steps):
        sched.on_request(program_id, tokens, group=group)
        clock.now += 1.0
        sched.on_response(program_id, tokens, 0)


def with_status(sched: Scheduler, status: Status) -> list[str]:
    """Which of the two compared samples are in `status`."""
    return [p for p in ("short-1", "long-1") if sched.programs[p].status is status]


def first_resumed(critical_path: bool) -> str:
    """`short-1` and `long-1` have run a step each and are paused; a hog fills the worker;
    `short-1` asks first, `long-1` a second later; the hog ends. Returns who got the room."""
    sched, clock = batch(critical_path)
    for program_id, group in (("short-1", "short"), ("long-1", "long")):
        run_steps(sched, clock, program_id, 1, SIZE, group)
        sched.forget_cached_contexts()  # paused: its next request waits for room
    assert sched.on_request("hog", HOG) == "a"
    assert sched.on_request("short-1", SIZE) is None
    clock.now += 1.0
    assert sched.on_request("long-1", SIZE) is None
    sched.on_response("hog", HOG, 0)
    sched.release("hog")
    (active,) = with_status(sched, Status.ACTIVE)
    return active


def test_in_a_batch_the_sample_with_the_most_work_left_resumes_first() -> None:
    assert first_resumed(critical_path=True) == "long-1"


def test_without_the_law_the_sample_that_asked_first_resumes_first() -> None:
    assert first_resumed(critical_path=False) == "short-1"


def first_paused(critical_path: bool) -> str:
    """`long-1` answers, then `short-1` a second later; their contexts grow past the pause
    threshold together. Returns which of the two a tick pauses."""
    sched, clock = batch(critical_path)
    for program_id, group in (("long-1", "long"), ("short-1", "short")):
        assert sched.on_request(program_id, 300, group=group) == "a"
    for program_id in ("long-1", "short-1"):
        clock.now += 1.0
        sched.on_response(program_id, 480, 0)  # 960 of 1,000 tokens: over the 0.95 threshold
    sched.tick()
    (paused,) = with_status(sched, Status.PAUSED)
    return paused


def test_in_a_batch_the_sample_with_the_least_work_left_pauses_first() -> None:
    assert first_paused(critical_path=True) == "short-1"


def test_without_the_law_the_one_longest_in_its_tool_pauses_first() -> None:
    assert first_paused(critical_path=False) == "long-1"


def priced_pauses(critical_path: bool) -> set[str]:
    """Tools that last 40 s, far longer than a re-prefill; `long-1` and `short-1` hold their KV
    in a tool while a program larger than the worker waits. Returns whom priced retention paused."""
    sched, clock = batch(critical_path, retention=True)
    for _ in range(8):
        assert sched.on_request("trainer", 10) == "a"
        sched.on_response("trainer", 10, 0)
        clock.now += 40.0
    sched.release("trainer")
    for program_id, group in (("long-1", "long"), ("short-1", "short")):
        run_steps(sched, clock, program_id, 1, 300, group)
    assert sched.on_request("waiter", 2000) is None
    clock.now += 1.0
    sched.tick()
    return set(with_status(sched, Status.PAUSED))


def test_priced_retention_keeps_the_kv_of_the_batch_program_with_the_most_work_left() -> None:
    assert priced_pauses(critical_path=True) == {"short-1"}


def test_without_the_law_priced_retention_drops_both() -> None:
    assert priced_pauses(critical_path=False) == {"short-1", "long-1"}


def test_a_group_with_none_ended_expects_its_leader_to_go_on_as_the_cluster_s_law_says() -> None:
    # Two samples running at 3 and 5 steps, none ended: the group knows each lasts at least 5; past
    # that the cluster's law says 4 more. The one at 3 has 2 + 4 + 1 (the step at 5 itself) left.
    left = steps_left([], [3, 5], tail=lambda steps: 4.0)
    assert left[5] == 4.0
    assert left[3] == 6.0


def test_a_group_whose_samples_all_ended_expects_no_more_past_its_longest() -> None:
    left = steps_left([4, 6], [], tail=lambda steps: 10.0)
    assert left[6] == 0.0
    assert left[4] == 2.0  # the one still running past 4 is the one of 6


def test_the_lengths_of_a_group_s_ended_samples_survive_a_restart_and_an_older_journal_has_none() -> None:
    book = GroupBook(SchedulerConfig())
    book.restore([["g", ["a"], 2, [7, 3]], ["old", ["b"], 1]])
    assert book.groups["g"].lengths == [3, 7]
    assert book.groups["old"].lengths == []
    assert book.snapshot()[0] == ["g", ["a"], 2, [3, 7]]
