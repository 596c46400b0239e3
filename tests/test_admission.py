"""The adaptive admission law (docs/admission.md) against simulated loads, tick by tick on a
fake clock: each load gives steps/s (and worker utilisation) as a function of the level."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from thunderctl.scheduler import SchedulerConfig
from thunderctl.scheduler.admission import OPEN, AdmissionTuner, Measurement, admission_levels

WINDOW_S = 10.0
Level = float | None


def tuner(**overrides) -> AdmissionTuner:
    settings = {
        "adaptive.window_s": WINDOW_S,
        "adaptive.settle_s": 5.0,
        "adaptive.tolerance": 0.1,
        "adaptive.probe_windows": 8,
    }
    return AdmissionTuner(SchedulerConfig(**(settings | overrides)))


def simulate(
    law: AdmissionTuner,
    steps_per_s: dict[Level, float],
    seconds: int,
    busy: Callable[[Level], float] = lambda level: 1.0,
    waiting: bool = True,
) -> list[Level]:
    """One tick a second; returns the level the law was at in each second."""
    steps, levels = 0.0, []
    law.observe(0.0, 0, 1.0, False)
    for now in range(1, seconds + 1):
        level = law.level
        steps += steps_per_s[level]
        law.observe(float(now), round(steps), busy(level), waiting, waited_throughout=waiting, arrived=waiting)
        levels.append(level)
    return levels


def moves(levels: list[Level]) -> list[Level]:
    """The levels the law went to, in order."""
    return [b for a, b in zip(levels, levels[1:]) if a != b]


DEAR = {1.0: 10, 0.5: 8, 0.0: 6, OPEN: 5}  # recompute dear: protecting the cache wins
CHEAP = {1.0: 4, 0.5: 5, 0.0: 6, OPEN: 10}  # recompute cheap: the engine alone wins
INTERIOR = {1.0: 6, 0.5: 10, 0.0: 7, OPEN: 6}
FLAT = {1.0: 10, 0.5: 10.3, 0.0: 10, OPEN: 10}


@pytest.mark.parametrize(
    ("load", "first_moves"),
    [
        pytest.param(DEAR, [OPEN, 1.0, 0.5, 1.0], id="the probed rungs are worse: back each time"),
        pytest.param(CHEAP, [OPEN, 0.0, OPEN], id="the engine alone is better: there in one probe"),
        pytest.param(INTERIOR, [OPEN, 1.0, 0.5, 0.0, 0.5], id="an interior best rung is found"),
        pytest.param(FLAT, [OPEN, 1.0, 0.5, 1.0], id="level: back to protection"),
    ],
)
def test_law_climbs_towards_more_steps(load, first_moves) -> None:
    assert moves(simulate(tuner(), load, 300))[: len(first_moves)] == first_moves


@pytest.mark.parametrize(
    ("load", "best"),
    [
        pytest.param(DEAR, 1.0, id="recompute dear: the reference policy"),
        pytest.param(CHEAP, OPEN, id="recompute cheap: the open gate"),
        pytest.param(INTERIOR, 0.5, id="an interior optimum"),
        pytest.param(FLAT, 1.0, id="flat: protection"),
        pytest.param({1.0: 4, 0.5: 5, 0.0: 8, OPEN: 8.3}, OPEN, id="weight 0 level with the open gate: the gate"),
    ],
)
def test_law_settles_on_the_best_rung_and_rarely_leaves_it(load, best) -> None:
    settled = simulate(tuner(), load, 3000)[300:]
    assert settled[-1] == best
    assert settled.count(best) / len(settled) >= 0.9, "probes cost at most one second in ten"


def test_nobody_waiting_moves_nothing() -> None:
    assert moves(simulate(tuner(), CHEAP, 120, waiting=False)) == []


def test_starved_workers_take_the_law_a_rung_down_at_once() -> None:
    levels = simulate(tuner(), DEAR, 3, busy=lambda level: 0.3 if level == 1.0 else 1.0)
    assert levels[:2] == [1.0, 0.5]


def test_a_starved_rung_is_not_probed_again_soon() -> None:
    levels = simulate(tuner(), DEAR, 60, busy=lambda level: 0.3 if level == 1.0 else 1.0)
    assert levels[2:].count(1.0) == 0


def test_idle_workers_while_a_load_arrives_are_not_starvation() -> None:
    law = tuner()
    law.observe(0.0, 0, 1.0, False)
    law.observe(1.0, 0, 0.3, waited=True, waited_throughout=False)  # the queue filled this tick
    assert law.weight == 1.0


def test_open_gate_without_load_measures_nothing() -> None:
    law = tuner()
    law.rung = len(law.levels) - 1
    simulate(law, {OPEN: 0.0}, 30, waiting=False)
    assert law.gate_open and not law.measured


def test_probes_that_find_nothing_better_get_rarer() -> None:
    levels = simulate(tuner(), DEAR, 1500)
    starts = [i for i in range(1, len(levels)) if levels[i] == 0.5 and levels[i - 1] == 1.0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], f"probes began at {starts}"


def test_without_the_open_gate_the_last_rung_is_the_floor() -> None:
    law = tuner(**{"adaptive.open_gate": False, "adaptive.weight_min": 0.5})
    simulate(law, {1.0: 4, 0.5: 10}, 60, busy=lambda level: 0.3)
    assert law.weight == 0.5 and not law.gate_open


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, [1.0, 0.5, 0.0, OPEN]),
        ({"adaptive.step": 0.25}, [1.0, 0.75, 0.5, 0.25, 0.0, OPEN]),
        (
            {
                "admission.acting_overbook": 0.8,
                "adaptive.weight_min": 0.3,
                "adaptive.step": 0.25,
                "adaptive.open_gate": False,
            },
            [0.8, 0.55, 0.3],
        ),
        ({"adaptive.step": 0.4}, [1.0, 0.6, 0.2, 0.0, OPEN]),
    ],
)
def test_ladder_runs_from_the_ceiling_to_the_floor(overrides, expected) -> None:
    assert admission_levels(SchedulerConfig(**overrides)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("loaded_s", "measured"),
    [
        pytest.param(2, None, id="ended early in the window: not measured"),
        pytest.param(8, 10.0, id="ended late: measured over the seconds with load"),
    ],
)
def test_a_load_that_ends_inside_a_window_is_not_read_as_a_slow_rung(loaded_s, measured) -> None:
    """The load (10 steps/s behind the open gate, where full protection made 4) stops sending
    inside the first window, and its last answers trickle in: the steps it did not send say
    nothing about the gate, and the law does not go back to full protection."""
    law = tuner()
    law.rung = open_rung = len(law.levels) - 1
    law.measured[0] = Measurement(4.0, 0)
    law.observe(0.0, 0, 1.0, False)
    steps, settle_s = 0, 5
    for now in range(1, 41):
        sending = now <= 1 + settle_s + loaded_s
        draining = not sending and now <= 1 + settle_s + loaded_s + 5  # the last answers trickle in
        steps += 10 if sending else 2 if draining else 0
        law.observe(float(now), steps, 1.0, waited=False, arrived=sending)
    assert law.level != 1.0
    reading = law.measured.get(open_rung)
    assert (reading and reading.steps_per_s) == measured


def test_when_retention_pays_the_top_rung_is_not_probed() -> None:
    law = tuner()
    law.retention_pays = True
    assert moves(simulate(law, CHEAP, 600)) == []


def test_from_the_open_gate_full_protection_is_not_probed() -> None:
    levels = simulate(tuner(), CHEAP, 3000)
    assert levels[60:].count(1.0) == 0


def test_a_probe_that_wins_by_far_is_kept_a_probe_interval() -> None:
    """Full protection made 0.4x the open gate's steps: the gate is where the load is, and its
    other neighbour is probed a probe interval later, not in the next window."""
    levels = simulate(tuner(), CHEAP, 300)
    arrived = levels.index(OPEN)
    left = next(i for i in range(arrived, len(levels)) if levels[i] is not OPEN)
    assert left - arrived >= 8 * WINDOW_S, f"at the gate from {arrived} s, left at {left} s"


def test_a_rung_measured_far_below_the_best_waits_the_longest_for_its_next_probe() -> None:
    levels = simulate(tuner(), CHEAP, 1000)
    probes = [i for i in range(1, len(levels)) if levels[i] == 0.0 and levels[i - 1] is OPEN]
    longest_wait_s = 4 * 8 * WINDOW_S
    assert probes[1] - probes[0] >= longest_wait_s, f"weight 0 probed at {probes}"
