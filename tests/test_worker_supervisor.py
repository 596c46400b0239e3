"""When the daemon starts a dead worker again: at once, then with a doubling, capped backoff that
a healthy worker resets; never when restarts are off or the worker still runs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from thunderctl.daemon.restarts import RestartPlanner
from thunderctl.profile import RestartPolicy

POLICY = RestartPolicy(initial_backoff_s=5.0, max_backoff_s=30.0)


def restart_times(planner: RestartPlanner, dead_until_s: float, step_s: float = 1.0) -> list[float]:
    """Check a worker that dies as soon as it starts, every `step_s`, and note each restart."""
    times = []
    now = 0.0
    while now <= dead_until_s:
        if planner.should_restart("w", alive=False, healthy=False, now_s=now):
            planner.restarted("w", now)
            times.append(now)
        now += step_s
    return times


def test_a_dead_worker_is_restarted_at_once_then_ever_more_slowly_up_to_the_cap() -> None:
    assert restart_times(RestartPlanner(POLICY), dead_until_s=130) == [0, 5, 15, 35, 65, 95, 125]


def test_a_worker_that_came_back_healthy_starts_its_backoff_afresh() -> None:
    planner = RestartPlanner(POLICY)
    for now in (0.0, 5.0, 15.0):
        assert planner.should_restart("w", alive=False, healthy=False, now_s=now)
        planner.restarted("w", now)
    assert not planner.should_restart("w", alive=True, healthy=True, now_s=100.0)
    assert planner.should_restart("w", alive=False, healthy=False, now_s=101.0)
    planner.restarted("w", 101.0)
    assert not planner.should_restart("w", alive=False, healthy=False, now_s=105.0)
    assert planner.should_restart("w", alive=False, healthy=False, now_s=106.0)


def test_a_worker_that_runs_but_is_not_yet_healthy_is_left_to_start() -> None:
    planner = RestartPlanner(POLICY)
    planner.restarted("w", 0.0)
    assert not planner.should_restart("w", alive=True, healthy=False, now_s=60.0)
    assert planner.should_restart("w", alive=False, healthy=False, now_s=61.0)
    planner.restarted("w", 61.0)
    assert not planner.should_restart("w", alive=False, healthy=False, now_s=70.0), (
        "still backing off: it was never healthy"
    )


def test_with_restarts_off_a_dead_worker_stays_dead() -> None:
    planner = RestartPlanner(RestartPolicy(enabled=False))
    assert restart_times(planner, dead_until_s=600) == []


def test_a_cap_below_the_first_wait_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError, match="max_backoff_s: 2 is below initial_backoff_s: 5"):
        RestartPolicy(initial_backoff_s=5, max_backoff_s=2)
