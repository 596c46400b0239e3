"""The adaptive admission law (docs/admission.md), window by window on a fake clock."""

from __future__ import annotations

import pytest

from thunderctl.scheduler import SchedulerConfig
from thunderctl.scheduler.admission import OPEN, AdmissionTuner, admission_levels

WINDOW_S = 10.0
BUSY, IDLE = 1.0, 0.3


def tuner(**overrides) -> AdmissionTuner:
    settings = dict(adapt_window_s=WINDOW_S, adapt_step=0.25, adapt_tolerance=0.1, adapt_probe_windows=8)
    return AdmissionTuner(SchedulerConfig(**(settings | overrides)))


def levels_after(law: AdmissionTuner, windows: list[tuple[float, float, bool]]) -> list[float | None]:
    """Each window: (steps per second, utilisation, whether requests waited); returns the
    level after each (an ACTING weight, or OPEN)."""
    now, steps, levels = 0.0, 0, []
    law.observe(now, steps, BUSY, False)
    for steps_per_s, utilization, waited in windows:
        now += WINDOW_S
        steps += round(steps_per_s * WINDOW_S)
        law.observe(now, steps, utilization, waited, waited_throughout=waited)
        levels.append(law.levels[law.rung])
    return levels


def busy(*rates: float) -> list[tuple[float, float, bool]]:
    return [(rate, BUSY, True) for rate in rates]


@pytest.mark.parametrize(
    ("windows", "expected"),
    [
        pytest.param([(10, BUSY, False)] * 3, [1.0, 1.0, 1.0], id="nobody waits: full protection holds"),
        pytest.param([(10, IDLE, True)] * 2, [0.75, 0.5], id="engines idle while requests wait: a rung down at once"),
        pytest.param(busy(10), [0.75], id="first measured window: probe the next rung"),
        pytest.param(busy(10, 12), [0.75, 0.5], id="more admission measured better: go on"),
        pytest.param(busy(10, 8), [0.75, 1.0], id="measured worse: back"),
        pytest.param(busy(10, 10.5), [0.75, 1.0], id="measured level: back to protection"),
        pytest.param(busy(10, 8, 10, 10), [0.75, 1.0, 1.0, 1.0], id="the best known rung holds"),
        pytest.param(busy(10, 12, 11), [0.75, 0.5, 0.75], id="an interior best rung is found"),
        pytest.param(busy(10, 12, 15, 19, 24, 30), [0.75, 0.5, 0.25, 0.0, OPEN, OPEN], id="down to the open gate"),
        pytest.param(busy(10, 12, 15, 19, 24) + [(30, BUSY, False)], [0.75, 0.5, 0.25, 0.0, OPEN, OPEN], id="open gate measures without waiting"),
        pytest.param([(10, BUSY, True), (10, BUSY, False), (12, BUSY, True)], [0.75, 0.75, 0.5], id="a window without waiting moves nothing"),
        pytest.param([(10, IDLE, True), (10, BUSY, True), (10, BUSY, True)], [0.75, 0.5, 0.75], id="a starved rung is not probed again soon"),
    ],
)
def test_admission_law(windows, expected) -> None:
    assert levels_after(tuner(), windows) == pytest.approx(expected)


def run_on_plant(law: AdmissionTuner, steps_per_s: dict[float | None, float], windows: int) -> list[float | None]:
    """The law against a load whose steps/s depend only on the level; the levels it chose."""
    now, steps, levels = 0.0, 0, []
    law.observe(now, steps, BUSY, False)
    for _ in range(windows):
        now += WINDOW_S
        steps += round(steps_per_s[law.levels[law.rung]] * WINDOW_S)
        law.observe(now, steps, BUSY, True, waited_throughout=True)
        levels.append(law.levels[law.rung])
    return levels


@pytest.mark.parametrize(
    ("plant", "best"),
    [
        pytest.param({1.0: 10, 0.75: 8, 0.5: 7, 0.25: 6, 0.0: 5, OPEN: 4}, 1.0, id="recompute dear: the reference policy"),
        pytest.param({1.0: 4, 0.75: 5, 0.5: 6, 0.25: 7, 0.0: 8, OPEN: 10}, OPEN, id="recompute cheap: the open gate"),
        pytest.param({1.0: 6, 0.75: 8, 0.5: 10, 0.25: 8, 0.0: 7, OPEN: 6}, 0.5, id="an interior optimum"),
        pytest.param({1.0: 10, 0.75: 10, 0.5: 10.2, 0.25: 10, 0.0: 10, OPEN: 10}, 1.0, id="flat: protection"),
    ],
)
def test_law_settles_on_the_best_rung_and_rarely_leaves_it(plant, best) -> None:
    levels = run_on_plant(tuner(), plant, windows=200)
    settled = levels[20:]
    assert settled[-1] == best
    assert settled.count(best) / len(settled) >= 0.9, "probes cost at most one window in ten"


def test_probes_that_find_nothing_better_get_rarer() -> None:
    levels = run_on_plant(tuner(), {1.0: 10, 0.75: 8, 0.5: 7, 0.25: 6, 0.0: 5, OPEN: 4}, windows=120)
    probes = [i for i, level in enumerate(levels) if level == 0.75]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], f"probe windows {probes}"


def test_without_the_open_gate_the_last_rung_is_the_floor() -> None:
    law = tuner(adapt_open_gate=False, acting_weight_min=0.5)
    assert levels_after(law, [(10, IDLE, True)] * 4)[-1] == 0.5
    assert not law.gate_open


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, [1.0, 0.5, 0.0, OPEN]),
        ({"adapt_step": 0.25}, [1.0, 0.75, 0.5, 0.25, 0.0, OPEN]),
        ({"acting_overbook": 0.8, "acting_weight_min": 0.3, "adapt_step": 0.25, "adapt_open_gate": False}, [0.8, 0.55, 0.3]),
        ({"adapt_step": 0.4}, [1.0, 0.6, 0.2, 0.0, OPEN]),
    ],
)
def test_ladder_runs_from_the_ceiling_to_the_floor(overrides, expected) -> None:
    assert admission_levels(SchedulerConfig(**overrides)) == pytest.approx(expected)


def test_idle_workers_while_a_load_arrives_are_not_starvation() -> None:
    law = tuner()
    law.observe(0.0, 0, BUSY, False)
    law.observe(1.0, 0, IDLE, waited=True, waited_throughout=False)  # the queue filled this tick
    assert law.weight == 1.0


def test_open_gate_without_load_measures_nothing() -> None:
    law = tuner()
    law.rung = len(law.levels) - 1
    law.observe(0.0, 0, BUSY, False)
    law.observe(WINDOW_S, 0, 0.0, False)  # a quiet window: 0 steps/s is no evidence against it
    assert law.gate_open and not law.measured


def test_nothing_moves_before_a_window_has_passed() -> None:
    law = tuner()
    law.observe(0.0, 0, BUSY, True)
    law.observe(WINDOW_S / 2, 50, BUSY, True)
    assert law.weight == 1.0
