"""The scheduling policy, rule by rule, on a fake clock (no I/O anywhere)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from thunderctl.scheduler import (
    Decay,
    EventKind,
    PauseOrder,
    Phase,
    ProgramEvent,
    Scheduler,
    SchedulerConfig,
    Status,
)
from thunderctl.scheduler.ending import AnswerKinds, Continuations
from thunderctl.sim.clock import VirtualClock

# Round numbers: capacity 1000, no per-program buffer unless a test asks for one.
BASE = {
    "admission.pause_threshold": 0.95,
    "admission.pause_target": 0.8,
    "admission.resume_threshold": 0.9,
    "admission.buffer_tokens": 0,
    "waits.forced_resume_s": 60,
    "ending.unlearnt_s": 300,
}


def make(
    capacities: dict[str, int | None] | None = None, **overrides
) -> tuple[Scheduler, VirtualClock, list[ProgramEvent]]:
    clock = VirtualClock(1000.0)
    events: list[ProgramEvent] = []
    sched = Scheduler(SchedulerConfig(**(BASE | overrides)), clock, [events.append])
    for worker_id, capacity in (capacities or {"a": 1000}).items():
        sched.add_worker(worker_id, capacity)
    return sched, clock, events


def run_step(sched: Scheduler, program_id: str, prompt: int, completion: int = 0) -> str | None:
    """One full turn: request admitted, response with the given usage."""
    worker = sched.on_request(program_id, prompt)
    if worker is not None:
        sched.on_response(program_id, prompt, completion)
    return worker


def assert_settled(sched: Scheduler, clock: VirtualClock, events: list[ProgramEvent], message: str) -> None:
    """Further ticks on an unchanged load pause and resume nothing, and stay under the threshold."""
    settled = len(events)
    for _ in range(5):
        clock.now += 5
        sched.tick()
    assert len(events) == settled, message
    assert sched.reserved_tokens("a") <= 950


def kinds(events: list[ProgramEvent], program_id: str) -> list[EventKind]:
    return [e.kind for e in events if e.program.id == program_id]


def test_new_program_is_admitted_at_once_when_there_is_room() -> None:
    sched, _, _ = make()
    assert sched.on_request("p", 300) == "a"
    assert sched.programs["p"].status is Status.ACTIVE
    assert sched.programs["p"].phase is Phase.REASONING


def test_program_stays_on_its_backend_across_turns() -> None:
    sched, _, _ = make({"a": 1000, "b": 1000})
    first = run_step(sched, "p", 100, 10)
    assert all(run_step(sched, "p", 110 + 20 * i, 10) == first for i in range(5))


def test_usage_from_the_engine_replaces_the_estimate() -> None:
    sched, _, _ = make()
    sched.on_request("p", 500)
    sched.on_response("p", prompt_tokens=420, completion_tokens=30)
    assert sched.programs["p"].tokens == 450
    assert sched.reserved_tokens("a") == 450


def test_new_program_waits_when_full_and_runs_after_a_release() -> None:
    sched, _, events = make()
    run_step(sched, "big", 850)
    assert sched.on_request("late", 200) is None
    assert sched.programs["late"].status is Status.PAUSED
    sched.release("big")
    assert sched.programs["late"].status is Status.ACTIVE
    assert kinds(events, "late") == [EventKind.CREATED, EventKind.RESUMED]


@pytest.mark.parametrize(
    ("sizes", "paused"),
    [
        # over 950 → pause shortest ACTING first until at or under 800
        ({"p1": 100, "p2": 200, "p3": 700}, {"p1", "p2"}),
        ({"p1": 290, "p2": 300, "p3": 390}, {"p1"}),
        ({"p1": 60, "p2": 900}, {"p1", "p2"}),
        # at or under the threshold nothing pauses
        ({"p1": 450, "p2": 500}, set()),
    ],
)
def test_tick_pauses_acting_programs_shortest_first_down_to_target(sizes, paused) -> None:
    sched, _, _ = make(**{"admission.resume_threshold": 0.9, "admission.pause_threshold": 0.95})
    for pid in sizes:
        run_step(sched, pid, 10)
    for pid, size in sizes.items():  # grow after admission, as contexts do
        sched.on_request(pid, size)
        sched.on_response(pid, size, 0)
    sched.tick()
    assert {p.id for p in sched.paused()} == paused


def test_reasoning_program_is_never_cut_and_pauses_at_its_tool_boundary() -> None:
    sched, _, events = make()
    sched.on_request("r1", 100)
    sched.on_request("r2", 100)
    sched.on_request("r1", 500)  # both decoding and grown: 980 > 950
    sched.on_request("r2", 480)
    sched.tick()
    assert not sched.paused()
    assert sched.programs["r2"].pause_at_boundary and not sched.programs["r1"].pause_at_boundary
    sched.on_response("r2", 480, 20)
    assert sched.programs["r2"].status is Status.PAUSED
    assert kinds(events, "r2")[-1] is EventKind.PAUSED


def test_acting_programs_pause_before_reasoning_ones() -> None:
    sched, _, _ = make()
    run_step(sched, "acting_big", 600)
    sched.on_request("reasoning_small", 100)
    sched.on_request("reasoning_small", 380)
    sched.tick()
    assert [p.id for p in sched.paused()] == ["acting_big"]
    assert not sched.programs["reasoning_small"].pause_at_boundary


def test_resume_runs_before_pause_within_one_tick() -> None:
    sched, clock, _ = make()
    run_step(sched, "x", 500)
    run_step(sched, "y", 300)
    sched.on_request("waiter", 150)  # 950: no room under the resume band
    assert sched.programs["waiter"].status is Status.PAUSED
    sched.on_request("x", 700)
    sched.on_response("x", 700, 0)  # 1000 > 950: this tick pauses y (shortest ACTING)
    sched.tick()
    assert {p.id for p in sched.paused()} == {"y", "waiter"}
    clock.now += 5
    sched.tick()  # the next tick resumes the waiter into the room the pause made
    assert sched.programs["waiter"].status is Status.ACTIVE
    assert sched.programs["y"].status is Status.PAUSED


@pytest.mark.parametrize(
    ("capacity", "resumed"),
    [
        # headroom = 0.9 x capacity; the queue is w_short(100) w_long(300) new_tiny(10) idle(50)
        (120, {"w_short"}),
        (450, {"w_short", "w_long"}),  # new_tiny would fit the rest but waits its turn
        (1000, {"w_short", "w_long", "new_tiny", "idle"}),
    ],
)
def test_resume_order_is_waiting_then_new_then_acting_shortest_first(capacity, resumed) -> None:
    sched, _, _ = make()
    sched.on_request("anchor", 0)  # keeps the worker from counting as idle
    for pid, size in [("w_long", 300), ("w_short", 100), ("idle", 50)]:
        run_step(sched, pid, size)
    sched.add_worker("a", 10)
    sched.tick()  # every ACTING program pauses
    sched.set_schedulable("a", False)
    for pid, size in [("w_long", 300), ("w_short", 100), ("new_tiny", 10)]:
        assert sched.on_request(pid, size) is None
    sched.add_worker("a", capacity)
    sched.set_schedulable("a", True)
    sched.tick()
    assert {p.id for p in sched.programs.values() if p.status is Status.ACTIVE} - {"anchor"} == resumed


def test_new_program_waits_behind_paused_programs_with_requests() -> None:
    sched, _, _ = make()
    run_step(sched, "old", 400)
    run_step(sched, "hog", 480)
    sched.on_request("hog", 600)
    sched.on_response("hog", 600, 0)
    sched.tick()  # 1000 > 950: old (shorter) pauses
    assert sched.programs["old"].status is Status.PAUSED
    sched.on_request("old", 400)  # needs 400, only 300 under the band: waits
    assert sched.on_request("newcomer", 250) is None  # would fit, but old is ahead


def place_on(sched: Scheduler, worker_id: str, program_id: str, size: int) -> None:
    others = [b for b in sched.workers.values() if b.id != worker_id]
    for worker in others:
        worker.schedulable = False
    run_step(sched, program_id, size)
    for worker in others:
        worker.schedulable = True


@pytest.mark.parametrize(
    ("loads", "waiting", "placement"),
    [
        # headroom a=800 b=600: big takes a (800 -> 300), then small takes b; huge (800) still waits
        ({"a": 100, "b": 300}, {"big": 500, "small": 200, "huge": 800}, {"big": "a", "small": "b"}),
        # headroom a=400 b=900: big takes b (900 -> 300), then small takes a; huge still waits
        ({"a": 500, "b": 0}, {"big": 600, "small": 350, "huge": 800}, {"big": "b", "small": "a"}),
    ],
)
def test_while_others_wait_resume_places_largest_first_on_most_headroom(loads, waiting, placement) -> None:
    sched, _, _ = make({"a": 1000, "b": 1000})
    for worker_id, size in loads.items():
        place_on(sched, worker_id, f"load_{worker_id}", size)
    for worker_id in sched.workers:
        sched.set_schedulable(worker_id, False)
    for pid, size in waiting.items():
        assert sched.on_request(pid, size) is None
    for worker in sched.workers.values():
        worker.schedulable = True  # both at once, so the tick places them all
    sched.tick()
    assert {pid: sched.programs[pid].worker for pid in placement} == placement
    assert sched.programs["huge"].status is Status.PAUSED


def test_paused_program_resumes_on_another_backend_when_its_own_is_full() -> None:
    sched, _, _ = make({"a": 1000, "b": 1000})
    sched.set_schedulable("b", False)
    run_step(sched, "p", 300)
    run_step(sched, "q", 600)
    sched.on_request("q", 700)
    sched.on_response("q", 700, 0)
    sched.tick()  # 1000 on a: p pauses
    assert sched.programs["p"].status is Status.PAUSED
    sched.set_schedulable("b", True)
    assert sched.on_request("p", 300) == "b"


def test_forced_resume_after_timeout_even_when_full() -> None:
    # Priced retention would drop the hog after its first tool seconds (tests/test_retention.py).
    sched, clock, events = make(**{"retention.enabled": False})
    run_step(sched, "hog", 900)
    assert sched.on_request("starved", 300) is None
    clock.now += 30
    sched.tick()
    assert sched.programs["starved"].status is Status.PAUSED
    clock.now += 31
    sched.tick()
    assert sched.programs["starved"].status is Status.ACTIVE
    assert sched.counters.forced_resumes == 1
    assert any(e.forced for e in events if e.program.id == "starved")


def test_idle_program_expires_after_ttl_but_not_while_decoding() -> None:
    sched, clock, events = make()
    run_step(sched, "idle", 100)
    sched.on_request("decoding", 100)
    clock.now += 301
    sched.tick()
    assert "idle" not in sched.programs and "decoding" in sched.programs
    assert kinds(events, "idle")[-1] is EventKind.EXPIRED
    assert sched.reserved_tokens("a") == 100


def teach_gaps(sched: Scheduler, clock: VirtualClock, gaps_s: list[float], tool: str | None = None) -> None:
    """A program whose answers are continued after `gaps_s` (its tool times), then released."""
    sched.on_request("teacher", 10)
    for gap in gaps_s:
        sched.on_response("teacher", 10, 0, tool)
        clock.now += gap
        sched.on_request("teacher", 10)
    sched.on_response("teacher", 10, 0)
    sched.release("teacher")


@pytest.mark.parametrize(
    ("gaps_s", "alive_at_s", "ended_by_s"),
    [
        ([], 299, 301),  # nothing learnt yet: end_unlearnt_s
        ([5.0] * 7, 299, 301),  # fewer gaps than tool_time_min_samples: still unlearnt
        ([5.0] * 8, 29, 31),  # short tool times: the 30 s floor
        ([4.0] * 7 + [40.0], 119, 121),  # the longest of 8 gaps × margin 3
        ([60.0] * 100 + [5.0] * 8, 29, 31),  # an 8-gap window: older, longer gaps forgotten
    ],
)
def test_a_program_never_released_ends_by_the_learnt_continuation_gap(gaps_s, alive_at_s, ended_by_s) -> None:
    sched, clock, events = make(**{"retention.tool_time_window": 8, "ending.gap_window": 8})
    teach_gaps(sched, clock, gaps_s)
    run_step(sched, "p", 100)
    clock.now += alive_at_s
    sched.tick()
    assert "p" in sched.programs
    clock.now += ended_by_s - alive_at_s
    sched.tick()
    assert "p" not in sched.programs and kinds(events, "p")[-1] is EventKind.EXPIRED
    assert sched.reserved_tokens("a") == 0


def test_a_slow_tool_is_waited_for_by_its_own_gaps_among_fast_ones() -> None:
    sched, clock, _ = make(**{"retention.tool_time_window": 64, "ending.gap_window": 64})
    teach_gaps(sched, clock, [60.0] * 8, "pytest")
    teach_gaps(sched, clock, [2.0] * 64, "ls")  # the cluster's window has forgotten pytest's gaps
    sched.on_request("p", 100)
    sched.on_response("p", 100, 0, "pytest")
    clock.now += 179  # 3 × its tool's 60 s
    sched.tick()
    assert "p" in sched.programs


@pytest.mark.parametrize("waiting", [False, True])
def test_a_program_with_a_request_in_flight_or_waiting_never_ends(waiting) -> None:
    sched, clock, _ = make()
    teach_gaps(sched, clock, [5.0] * 8)
    if waiting:
        run_step(sched, "hog", 1000)  # no room: p's request waits
    assert (sched.on_request("p", 100) is None) is waiting
    clock.now += 59  # under the forced resume, past the floor
    sched.tick()
    assert "p" in sched.programs


def test_a_parent_whose_child_runs_does_not_end_and_ends_by_its_own_gaps_after_the_child() -> None:
    sched, clock, events = make()
    teach_gaps(sched, clock, [5.0] * 8)
    run_step(sched, "session", 100)
    clock.now += 20
    sched.on_request("session/agent", 50, parent="session")  # a subagent: the session waits on it
    for _ in range(4):  # the session silent far past the floor and its gaps while the child works
        sched.on_response("session/agent", 50, 10)
        clock.now += 5
        sched.tick()
        sched.on_request("session/agent", 50)
    assert "session" in sched.programs and sched.programs["session/agent"].parent == "session"
    sched.on_response("session/agent", 50, 10)
    sched.release("session/agent")
    clock.now += 29
    sched.tick()
    assert "session" in sched.programs  # its silence counts from the child's end
    clock.now += 2
    sched.tick()
    assert "session" not in sched.programs and kinds(events, "session")[-1] is EventKind.EXPIRED


def test_a_paused_program_silent_past_its_gap_is_not_resumed_into_room_others_need() -> None:
    sched, clock, _ = make(**{"retention.enabled": False})
    teach_gaps(sched, clock, [5.0] * 8)
    run_step(sched, "gone", 400)
    clock.now += 20  # past its expected 5 s, before the 30 s floor: not ended yet
    run_step(sched, "soon", 300)
    sched.drain("a")
    sched.set_schedulable("a", True)
    clock.now += 1
    sched.tick()
    assert sched.programs["soon"].status is Status.ACTIVE  # within its gap: room held ahead of it
    assert sched.programs["gone"].status is Status.PAUSED
    assert sched.on_request("live", 500) == "a"


def test_a_slow_tool_keeps_its_room_past_the_clusters_gaps_until_its_own_while_others_wait() -> None:
    sched, clock, _ = make(**{"retention.enabled": False, "retention.tool_time_window": 64, "ending.gap_window": 64})
    teach_gaps(sched, clock, [60.0] * 8, "pytest")
    teach_gaps(sched, clock, [2.0] * 64, "ls")  # the cluster's window has forgotten pytest's gaps
    sched.on_request("slow", 300)
    sched.on_response("slow", 300, 0, "pytest")
    clock.now += 20  # silent ten times the cluster's gaps, a third of its own tool's
    assert sched.on_request("hog", 800) is None
    sched.tick()
    assert sched.programs["slow"].status is Status.ACTIVE
    clock.now += 41  # past every gap its tool was seen to take: more likely ended than not
    sched.tick()
    assert sched.programs["slow"].status is Status.PAUSED
    assert sched.programs["hog"].status is Status.ACTIVE


def status_silent_while_others_wait(sched: Scheduler, clock: VirtualClock, silent_s: float) -> Status:
    """A program of 300 tokens answers and is silent `silent_s` while one of 800 waits for room."""
    run_step(sched, "slow", 300)
    clock.now += silent_s
    assert sched.on_request("hog", 800) is None
    sched.tick()
    return sched.programs["slow"].status


def test_programs_released_at_their_end_do_not_make_a_live_programs_silence_look_like_an_end() -> None:
    sched, clock, _ = make(**{"retention.enabled": False, "retention.tool_time_window": 100, "ending.gap_window": 100})
    teach_gaps(sched, clock, [2.0] * 90 + [10.0] * 10)
    for i in range(50):  # a client that releases: every end is said, none is silent
        run_step(sched, f"done{i}", 1)
        sched.release(f"done{i}")
    assert status_silent_while_others_wait(sched, clock, silent_s=5) is Status.ACTIVE  # past 9 gaps in 10


def test_live_programs_silent_within_the_floor_are_no_evidence_that_programs_end() -> None:
    sched, clock, _ = make(
        **{
            "retention.enabled": False,
            "retention.tool_time_window": 100,
            "ending.gap_window": 100,
            "ending.floor_s": 30,
        }
    )
    teach_gaps(sched, clock, [2.0] * 90 + [10.0] * 10)
    for i in range(20):
        run_step(sched, f"long{i}", 1)
    clock.now += 12  # in tools longer than any gap seen yet, as in the first minute of a run
    assert status_silent_while_others_wait(sched, clock, silent_s=9) is Status.ACTIVE  # past 9 gaps in 10


def test_answers_silent_past_every_gap_count_as_ends_before_any_expires() -> None:
    continuations = Continuations(window=1024)
    for _ in range(90):
        continuations.observe(continued=True)
    assert continuations.chance([]) > 0.98
    # Ten programs silent past every gap seen, none expired yet: one answer in ten was the last.
    continued = continuations.continued  # 90 answers, the older ones a little forgotten
    assert continuations.chance([0.0] * 10) == pytest.approx((continued + 1) / (continued + 10 + 2))
    # Silent within the gaps, they are as likely continued as any answer: no evidence of an end.
    assert continuations.chance([1.0] * 10) == pytest.approx(continuations.chance([]), abs=1e-3)


def test_the_continuation_chance_follows_the_recent_answers() -> None:
    continuations = Continuations(window=100)
    for _ in range(1000):
        continuations.observe(continued=True)
    for answer in range(500):  # five windows of answers of which half are the last
        continuations.observe(continued=bool(answer % 2))
    assert continuations.chance([]) == pytest.approx(0.5, abs=0.05)


def test_after_an_answer_of_the_kind_programs_end_on_a_silence_gives_up_its_room_and_after_a_tool_keeps_it() -> None:
    sched, clock, _ = make(**{"retention.enabled": False, "retention.tool_time_window": 100, "ending.gap_window": 100})
    teach_gaps(sched, clock, [2.0] * 90 + [10.0] * 10, "bash")
    for i in range(10):  # programs nobody releases, whose last answer calls no tool: one answer in five
        for tool in ["bash"] * 4 + [None]:
            sched.on_request(f"old{i}", 1)
            sched.on_response(f"old{i}", 1, 0, tool)
    clock.now += 31
    sched.tick()
    assert not any(program_id.startswith("old") for program_id in sched.programs), "they ended by the law"
    for program_id, tool in [("working", "bash"), ("done", None)]:
        sched.on_request(program_id, 300)
        sched.on_response(program_id, 300, 0, tool)
    clock.now += 5  # longer than 9 gaps in 10: alike, the two would both look ended
    assert sched.on_request("hog", 500) == "a"  # admitted at once, into the room the ended one gave up
    assert sched.programs["done"].status is Status.PAUSED
    assert sched.programs["working"].status is Status.ACTIVE


def test_a_kind_of_answer_seen_a_few_times_reads_as_the_mean_one() -> None:
    kinds = AnswerKinds(window=1024)
    for _ in range(100):
        for tool in ["bash"] * 9 + [None]:
            kinds.observe(tool, ended=tool is None)
    kinds.observe("rare", ended=True)
    ratios = kinds.ratios()
    assert ratios["bash"] < 0.2 and ratios[None] > 5  # a tool call is rarely the last answer, no tool call mostly is
    assert 1.0 < ratios["rare"] < 2.0


def test_release_is_idempotent_and_frees_the_reservation() -> None:
    sched, _, events = make()
    run_step(sched, "p", 400)
    assert sched.release("p") is True
    assert sched.release("p") is False
    assert sched.reserved_tokens("a") == 0
    assert kinds(events, "p").count(EventKind.RELEASED) == 1


@pytest.mark.parametrize(
    ("decay", "idle_s", "weight"),
    [
        (Decay.OFF, 100, 1.0),
        (Decay.EXP, 0, 1.0),
        (Decay.EXP, 10, 0.5),
        (Decay.EXP, 20, 0.25),
        (Decay.LINEAR, 5, 0.5),
        (Decay.LINEAR, 15, 0.0),
    ],
)
def test_acting_decay_weights_on_the_resume_side_only(decay, idle_s, weight) -> None:
    sched, clock, _ = make(**{"admission.acting_decay": decay, "admission.acting_decay_tau_s": 10})
    run_step(sched, "p", 400)
    clock.now += idle_s
    assert sched.room.load(sched.workers["a"], physical=False).tokens == pytest.approx(400 * weight)
    assert sched.reserved_tokens("a") == 400


def test_overbooking_admits_more_but_physical_check_still_pauses() -> None:
    sched, _, _ = make(**{"admission.acting_overbook": 0.5})
    run_step(sched, "a1", 800)
    assert sched.on_request("b1", 400) == "a"  # 0.5*800 + 400 <= 900
    sched.on_response("b1", 400, 0)
    sched.tick()  # physically 1200 > 950: pauses shortest ACTING
    assert [p.id for p in sched.paused()] == ["b1"]


def test_shared_prefix_is_charged_once_per_backend() -> None:
    sched, _, _ = make()
    for i in range(4):
        sched.on_request(f"p{i}", 300, prefix_key="sys", prefix_tokens=200)
    # 200 once + 4 x 100 private
    assert sched.reserved_tokens("a") == 600
    sched.release("p0")
    assert sched.reserved_tokens("a") == 500


def test_buffer_is_charged_the_same_on_both_sides_so_pausing_converges() -> None:
    sched, clock, events = make(**{"admission.buffer_tokens": 50, "retention.enabled": False})  # pausing by size alone
    for i in range(8):
        run_step(sched, f"p{i}", 100 + i)
    for i in range(8):
        sched.on_request(f"p{i}", 140 + i)
        sched.on_response(f"p{i}", 140 + i, 0)
    sched.tick()
    assert_settled(sched, clock, events, "a static load must not flap between pause and resume")


def test_backend_without_capacity_is_never_paused() -> None:
    sched, _, _ = make({"u": None})
    for i in range(20):
        assert run_step(sched, f"p{i}", 10_000) == "u"
    sched.tick()
    assert not sched.paused()


def test_failed_tick_resumes_every_paused_program() -> None:
    sched, _, _ = make()
    run_step(sched, "hog", 900)
    sched.on_request("w1", 300)
    sched.on_request("w2", 300)
    assert len(sched.paused()) == 2

    def broken() -> None:
        raise RuntimeError("policy bug")

    sched._pause_overfull = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        sched.tick()
    assert not sched.paused()
    assert sched.counters.tick_failures == 1


def test_failing_listener_does_not_stop_scheduling() -> None:
    def explode(event: ProgramEvent) -> None:
        raise RuntimeError("sandbox host down")

    sched, _, _ = make()
    sched.listeners.insert(0, explode)
    assert sched.on_request("p", 100) == "a"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"admission.pause_target": 0.96}, "pause_target"),
        ({"admission.resume_threshold": 0.99}, "resume_threshold"),
        ({"admission.buffer_tokens": -1}, "buffer_tokens"),
        ({"admission.acting_decay": "sometimes"}, "acting_decay"),
    ],
)
def test_config_rejects_inconsistent_bands(overrides, message) -> None:
    with pytest.raises(ValidationError, match=message):
        SchedulerConfig(**(BASE | overrides))


def test_drain_pauses_acting_programs_and_lets_reasoning_ones_finish() -> None:
    sched, _, _ = make({"a": 1000, "b": 1000})
    place_on(sched, "a", "tool", 300)
    sched.set_schedulable("b", False)
    sched.on_request("decode", 200)
    sched.set_schedulable("b", True)
    sched.drain("a")
    assert sched.programs["tool"].status is Status.PAUSED
    assert sched.programs["decode"].worker == "a" and sched.programs["decode"].pause_at_boundary
    sched.on_response("decode", 200, 10)
    assert sched.programs["decode"].status is Status.PAUSED  # at its tool boundary
    assert not sched.workers["a"].programs
    sched.tick()  # both resume elsewhere
    assert {sched.programs[p].worker for p in ("tool", "decode")} == {"b"}


def test_draining_backend_takes_no_new_program_until_undrained() -> None:
    sched, _, _ = make({"a": 1000})
    sched.drain("a")
    assert sched.on_request("new", 100) is None
    sched.set_schedulable("a", True)
    assert sched.programs["new"].status is Status.ACTIVE


def test_requeued_program_resumes_on_a_healthy_backend_first_in_line() -> None:
    sched, _, _ = make({"a": 1000, "b": 1000})
    place_on(sched, "a", "victim", 300)
    sched.on_request("victim", 350)
    sched.set_schedulable("a", False)  # the worker died
    sched.requeue("victim")
    program = sched.programs["victim"]
    assert program.status is Status.ACTIVE and program.worker == "b"
    assert program.phase is Phase.REASONING


def test_a_requeue_avoids_the_worker_that_failed_it_while_another_can_take_it() -> None:
    sched, _, _ = make({"a": 2000, "b": 1000})
    place_on(sched, "a", "slow", 300)  # a has the most room: without `avoid`, it would go back there
    sched.on_request("slow", 350)
    sched.requeue("slow", avoid="a")  # a did not take the connection in time: no verdict on it
    assert sched.programs["slow"].worker == "b" and sched.workers["a"].schedulable

    alone, _, _ = make({"a": 1000})
    place_on(alone, "a", "slow", 300)
    alone.on_request("slow", 350)
    alone.requeue("slow", avoid="a")  # no other worker: the same one again
    assert alone.programs["slow"].status is Status.ACTIVE and alone.programs["slow"].worker == "a"


def test_idle_engine_with_waiting_requests_admits_more_programs() -> None:
    sched, clock, _ = make()
    run_step(sched, "holder", 800)  # ACTING, holding most of the cache
    assert sched.on_request("waiter", 300) is None
    for _ in range(2):  # the queue filled in the first tick; the second it waited throughout
        clock.now += 1
        sched.adapt(utilization=0.2)
    assert sched.acting_weight == 0.5  # 400 + 300 fits under 900
    sched.tick()
    assert sched.programs["waiter"].status is Status.ACTIVE


def test_room_left_by_a_response_goes_to_the_waiting_queue_at_once() -> None:
    sched, _, _ = make(**{"adaptive.enabled": False, "admission.acting_overbook": 0.5})
    assert sched.on_request("holder", 800) == "a"
    assert sched.on_request("waiter", 300) is None  # 800 + 300 > 900 while the holder decodes
    sched.on_response("holder", 800, 0)  # ACTING at weight 0.5: 400 + 300 fits, no tick needed
    assert sched.programs["waiter"].status is Status.ACTIVE


def test_busy_engine_lowers_the_weight_while_steps_per_second_rise_until_the_queue_moves() -> None:
    # The ladder alone, the queue shortest first (no aging): the short workers pass the waiter.
    # No tool time trusted: the silent holder is not taken for ended (scheduler.md, Ending).
    sched, clock, _ = make(
        **{
            "adaptive.window_s": 10,
            "retention.enabled": False,
            "waits.aging_tokens_per_s": None,
            "retention.tool_time_min_samples": 10_000,
        }
    )
    run_step(sched, "holder", 800)
    sched.on_request("waiter", 850)  # fits only at weight 0
    responses_per_s = {1.0: 2, 0.5: 4, 0.0: 8}  # a load that more admission speeds up
    for _ in range(60):
        for i in range(responses_per_s[sched.acting_weight]):
            run_step(sched, f"worker-{i}", 1)
        clock.now += 1
        sched.adapt(utilization=1.0)
    assert sched.acting_weight == 0.0
    assert sched.programs["waiter"].status is Status.ACTIVE


def test_open_gate_admits_every_waiting_request_and_pauses_nobody() -> None:
    sched, clock, _ = make()
    sched.tuner.rung = len(sched.tuner.levels) - 1  # the law measured the engine alone better
    for i in range(3):
        assert run_step(sched, f"p{i}", 600) == "a"  # 1,800 tokens on a 1,000-token worker
    clock.now += 5
    sched.tick()
    assert not sched.paused()


def test_reference_policy_does_not_adapt() -> None:
    sched, _, _ = make(**{"adaptive.enabled": False})
    run_step(sched, "holder", 800)
    sched.on_request("waiter", 300)
    for _ in range(5):
        sched.adapt(utilization=0.0)
    sched.tick()
    assert sched.acting_weight == 1.0 and sched.programs["waiter"].status is Status.PAUSED


def test_overbooked_room_is_not_given_to_programs_without_a_request() -> None:
    sched, clock, events = make(**{"admission.acting_overbook": 0.5})
    for i in range(4):
        run_step(sched, f"p{i}", 300)  # 0.5-weighted: all four admitted
    sched.tick()  # physically 1200 > 950: pauses down to 800
    assert sched.paused()
    clock.now += 1
    sched.tick()  # may refill physical room up to the resume band, no further
    assert_settled(sched, clock, events, "paused idle programs must not flap through overbooked room")


def test_ledger_and_queue_match_a_full_recount_after_any_history() -> None:
    """The incrementally kept charges and queue equal a recount from scratch, whatever happened."""
    import random

    rng = random.Random(3)
    sched, clock, _ = make({"a": 3000, "b": 3000}, **{"admission.buffer_tokens": 16, "admission.acting_overbook": 0.6})
    for _ in range(2000):
        pid = f"p{rng.randrange(40)}"
        action = rng.random()
        if action < 0.45:
            sched.on_request(pid, rng.randrange(50, 900), prefix_key=rng.choice([None, "s1", "s2"]), prefix_tokens=40)
        elif action < 0.85 and pid in sched.programs:
            sched.on_response(pid, rng.randrange(50, 900), rng.randrange(1, 50))
        elif action < 0.9:
            sched.release(pid)
        else:
            clock.now += 1
            sched.adapt(rng.random())
            sched.tick()
        for worker in sched.workers.values():
            fast = sched.room.load(worker, physical=False).tokens
            recount = sum(
                ((1.0 if p.phase is Phase.REASONING else sched.acting_weight) * p.private_tokens + 16)
                for p in map(sched.programs.get, worker.programs)
            ) + sum(
                {
                    p.prefix_key: p.prefix_tokens for p in map(sched.programs.get, worker.programs) if p.prefix_key
                }.values()
            )
            assert fast == pytest.approx(recount, abs=1e-6)
            acting = {p.id for p in map(sched.programs.get, worker.programs) if p.phase is Phase.ACTING}
            heard = sched.room.ledgers[worker.id].heard  # what the pass over likely ended programs walks
            assert {i for _, i in heard} == acting and all(at <= sched.programs[i].last_activity for at, i in heard)
        waiting = [p for p in sched.resume_queue() if p.waiting_since is not None]
        assert list(sched._waiting) == [p.id for p in waiting]


def test_an_overfull_backend_pauses_the_program_longest_in_its_tool_first() -> None:
    sched, clock, _ = make()
    run_step(sched, "early", 300)  # its tool started first
    clock.now += 10
    run_step(sched, "late_small", 200)
    run_step(sched, "late_big", 400)
    sched.on_request("late_big", 480)
    sched.on_response("late_big", 480, 0)  # 980 > 950
    sched.tick()
    assert [p.id for p in sched.paused()] == ["early"]


def test_the_reference_pause_order_pauses_the_shortest_first() -> None:
    sched, clock, _ = make(**{"admission.pause_order": PauseOrder.SHORTEST})
    run_step(sched, "early", 300)
    clock.now += 10
    run_step(sched, "late_small", 200)
    run_step(sched, "late_big", 400)
    sched.on_request("late_big", 480)
    sched.on_response("late_big", 480, 0)
    sched.tick()
    assert [p.id for p in sched.paused()] == ["late_small"]
