"""Priced retention, driven tick by tick on a fake clock: whom the scheduler keeps while others wait."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from thunderctl.scheduler import Scheduler, SchedulerConfig, Status
from thunderctl.scheduler.retention import MAX_TOOL_KINDS, GapSamples, PrefillRate, ToolTimes
from thunderctl.sim.clock import VirtualClock

CAPACITY = 100_000
PREFILL_TOKENS_PER_S = 10_000.0  # the whole cache recomputes in 10 s: the break-even tool time
HOLDER_TOKENS = 20_000
WAITER_TOKENS = 150_000  # more than the worker holds: it waits until the worker is empty
MIN_SAMPLES = 8
TRAINING_GAPS = 200


def make(clock: VirtualClock) -> Scheduler:
    config = SchedulerConfig(
        adaptive={"enabled": False},
        admission={"buffer_tokens": 0},
        waits={"forced_resume_s": 10_000},
        ending={"floor_s": 100_000},
        retention={"prefill_tokens_per_s": PREFILL_TOKENS_PER_S, "tool_time_min_samples": MIN_SAMPLES},
    )  # fmt: skip
    sched = Scheduler(config, clock)
    sched.add_worker("a", CAPACITY)
    return sched


def train(
    sched: Scheduler, clock: VirtualClock, gaps: list[float], tool: str | None = None, program: str = "trainer"
) -> None:
    """A program whose tool calls take the given times, observed as the gateway observes them."""
    for gap in gaps:
        assert sched.on_request(program, 10) == "a"
        sched.on_response(program, 10, 0, tool=tool)
        clock.now += gap
    sched.release(program)


def expected_remaining(samples: list[float], elapsed: float) -> float:
    """The law as the issue states it: E[T − a | T > a] over what was seen, the time spent past it."""
    tail = [t for t in samples if t > elapsed]
    return sum(tail) / len(tail) - elapsed if len(tail) >= MIN_SAMPLES else elapsed


def priced_keep_set(holders: dict[str, float], samples: list[float], demand: float, return_chance: float) -> set[str]:
    """Which holders (id → time in tool) the priced comparison keeps, computed here from scratch."""
    kept = set(holders)
    remaining = {pid: expected_remaining(samples, elapsed) for pid, elapsed in holders.items()}
    for pid in sorted(holders, key=lambda p: (-remaining[p], p)):
        if demand <= 0:
            break
        keep = min(HOLDER_TOKENS, demand) * remaining[pid] / CAPACITY
        drop = return_chance * HOLDER_TOKENS / PREFILL_TOKENS_PER_S
        if keep > drop:
            kept.discard(pid)
            demand -= HOLDER_TOKENS
    return kept


def drive(draw: Callable[[random.Random], float], starts: list[float]) -> dict[str, list[tuple[float, bool]]]:
    """Holders whose tools started `starts` seconds before a request that cannot fit arrives;
    one tick a second for 30 s. Each tick, the scheduler must keep exactly the holders the
    priced comparison keeps. Returns, per holder, (time in tool, kept) at every tick."""
    rng = random.Random(7)
    clock = VirtualClock(1000.0)
    sched = make(clock)
    gaps = [draw(rng) for _ in range(TRAINING_GAPS)]
    train(sched, clock, gaps)
    samples = gaps[:-1]  # the last tool call ends in the program's release, not a request
    return_chance = (TRAINING_GAPS - 1 + 1) / (TRAINING_GAPS - 1 + 1 + 2)  # returns, one end
    base = clock.now + max(starts)
    responded = {}
    for index, start in enumerate(starts):
        pid = f"holder-{index}"
        clock.now = base - start
        assert sched.on_request(pid, HOLDER_TOKENS) == "a"
        sched.on_response(pid, HOLDER_TOKENS, 0)
        responded[pid] = clock.now
    clock.now = base
    assert sched.on_request("waiter", WAITER_TOKENS) is None
    history: dict[str, list[tuple[float, bool]]] = {pid: [] for pid in responded}
    for _ in range(30):
        clock.now += 1
        active = {pid: clock.now - responded[pid] for pid in responded if sched.programs[pid].status is Status.ACTIVE}
        demand = WAITER_TOKENS if sched.programs["waiter"].status is Status.PAUSED else 0
        want = priced_keep_set(active, samples, demand, return_chance)
        sched.tick()
        kept = {pid for pid in active if sched.programs[pid].status is Status.ACTIVE}
        assert kept == want, (
            f"at {clock.now - base:.0f} s: kept {sorted(kept)}, the priced comparison keeps {sorted(want)}"
        )
        for pid, elapsed in active.items():
            history[pid].append((elapsed, pid in kept))
    return history


def first_drop(history: list[tuple[float, bool]]) -> float | None:
    return next((elapsed for elapsed, kept in history if not kept), None)


def test_memoryless_tools_are_kept_whatever_the_time_spent() -> None:
    # Exponential, mean 4 s: the remaining time is 4 s at any elapsed time, under the 10 s a
    # re-prefill of the same room costs, so nothing is worth dropping.
    history = drive(lambda rng: rng.expovariate(1 / 4), starts=[0.0, 3.0, 6.0, 9.0])
    # Up to 10 s, while enough samples ran longer to say so (past them the law assumes the worst).
    assert all(kept for ticks in history.values() for elapsed, kept in ticks if elapsed <= 10)


def test_heavy_tailed_tools_are_dropped_once_they_have_run_long() -> None:
    # Pareto, α = 1.5 from 1 s: E[T − a | T > a] = 2a, so the longer a tool ran, the longer it
    # is expected to run, past the 10 s break-even within seconds.
    history = drive(lambda rng: rng.paretovariate(1.5), starts=[0.0, 2.0, 4.0])
    drops = [first_drop(ticks) for ticks in history.values()]
    assert all(drop is not None and 2 < drop <= 12 for drop in drops), drops


def test_near_deterministic_tools_are_kept_the_longer_they_ran() -> None:
    # Uniform 11.5–12.5 s: just begun, 12 s remain (above break-even: drop); after 3 s, under
    # 9.5 s remain and the program is soon back: keep.
    history = drive(lambda rng: rng.uniform(11.5, 12.5), starts=[0.0, 4.0, 6.0])
    by_start = sorted(history.values(), key=lambda ticks: ticks[0][0])
    fresh, *ran = by_start
    assert fresh[0] == (1.0, False)
    assert all(kept for ticks in ran for _, kept in ticks[:4])


def test_nothing_is_dropped_while_nobody_waits() -> None:
    clock = VirtualClock(1000.0)
    sched = make(clock)
    train(sched, clock, [60.0] * 20)  # tools far longer than a re-prefill
    assert sched.on_request("holder", HOLDER_TOKENS) == "a"
    sched.on_response("holder", HOLDER_TOKENS, 0)
    for _ in range(30):
        clock.now += 5
        sched.tick()
    assert sched.programs["holder"].status is Status.ACTIVE
    assert sched.counters.priced_pauses == 0


def test_the_tool_kind_named_by_the_answer_conditions_the_remaining_time() -> None:
    clock = VirtualClock(1000.0)
    sched = make(clock)
    train(sched, clock, [0.5] * 20, tool="ls", program="t1")
    train(sched, clock, [40.0] * 20, tool="pytest", program="t2")
    for pid, tool in (("lister", "ls"), ("tester", "pytest")):
        assert sched.on_request(pid, HOLDER_TOKENS) == "a"
        sched.on_response(pid, HOLDER_TOKENS, 0, tool=tool)
    assert sched.on_request("waiter", WAITER_TOKENS) is None
    clock.now += 0.2
    sched.tick()
    assert sched.programs["lister"].status is Status.ACTIVE  # 0.3 s left: cheaper kept
    assert sched.programs["tester"].status is Status.PAUSED  # 39.8 s left: cheaper recomputed


def test_a_dropped_program_comes_back_with_its_request_and_is_not_dropped_again_at_once() -> None:
    clock = VirtualClock(1000.0)
    sched = make(clock)
    train(sched, clock, [40.0] * 20)
    assert sched.on_request("holder", HOLDER_TOKENS) == "a"
    sched.on_response("holder", HOLDER_TOKENS, 0)
    assert sched.on_request("waiter", 90_000) is None
    clock.now += 1
    sched.tick()
    assert sched.programs["holder"].status is Status.PAUSED
    assert sched.programs["waiter"].status is Status.ACTIVE  # the room went to the queue at once
    sched.on_response("waiter", 90_000, 0)
    sched.release("waiter")
    clock.now += 39
    assert sched.on_request("holder", HOLDER_TOKENS) == "a"
    for _ in range(5):
        clock.now += 5
        sched.tick()
    assert sched.programs["holder"].status is Status.ACTIVE  # REASONING: never priced


def test_gap_samples_forget_the_oldest_beyond_their_window() -> None:
    samples = GapSamples(limit=3)
    for gap in (100.0, 1.0, 2.0, 3.0):
        samples.add(gap)
    assert len(samples) == 3
    assert samples.remaining(0.0, min_samples=1) == pytest.approx(2.0)
    assert samples.remaining(2.5, min_samples=1) == pytest.approx(0.5)
    assert samples.remaining(3.0, min_samples=1) is None


def test_a_gap_added_after_a_question_changes_the_next_answer() -> None:
    samples = GapSamples(limit=8)
    for gap in (1.0, 2.0, 3.0):
        samples.add(gap)
    assert samples.remaining(0.0, min_samples=1) == pytest.approx(2.0)
    samples.add(10.0)  # the tail asked about just now is longer by it
    assert samples.remaining(0.0, min_samples=1) == pytest.approx(4.0)


def test_tool_kinds_are_bounded_the_least_recently_called_forgotten() -> None:
    # Agents that run bash name their tool by the command's first word: a script path of each
    # task is a tool kind of its own, and a gateway up for weeks sees unboundedly many.
    times = ToolTimes(window=16, min_samples=2)
    for i in range(3 * MAX_TOOL_KINDS):
        times.observe("p", f"run_task_{i}.sh", 1.0)
        times.observe("p", "pytest", 30.0)  # called all along: kept
    assert len(times.by_tool) <= MAX_TOOL_KINDS
    assert "pytest" in times.by_tool and f"run_task_{3 * MAX_TOOL_KINDS - 1}.sh" in times.by_tool
    assert "run_task_0.sh" not in times.by_tool


def test_tool_times_fall_back_from_tool_to_program_to_cluster_and_past_all_evidence_to_elapsed() -> None:
    times = ToolTimes(window=16, min_samples=2)
    for _ in range(4):
        times.observe("p", "pytest", 30.0)
        times.observe("q", None, 2.0)
    assert times.remaining("other", "pytest", 10.0) == pytest.approx(20.0)  # the tool kind
    assert times.remaining("q", "unknown", 1.0) == pytest.approx(1.0)  # the program
    assert times.remaining("new", None, 0.0) == pytest.approx(16.0)  # the cluster: (30+2)/2
    assert times.remaining("new", None, 45.0) == pytest.approx(45.0)  # beyond every sample


def test_the_prefill_rate_follows_measurements() -> None:
    rate = PrefillRate(1000.0)
    for _ in range(100):
        rate.observe(4000, 1.0)
    assert rate.tokens_per_s == pytest.approx(4000.0, rel=0.01)
    rate.observe(0, 1.0)  # a full cache hit says nothing of the rate
    assert rate.tokens_per_s == pytest.approx(4000.0, rel=0.01)
