"""The adaptive admission law (docs/admission.md), window by window on a fake clock."""

from __future__ import annotations

import pytest

from thunderctl.scheduler import SchedulerConfig
from thunderctl.scheduler.admission import AdmissionTuner

WINDOW_S = 10.0


def tuner(**overrides) -> AdmissionTuner:
    config = SchedulerConfig(adapt_window_s=WINDOW_S, adapt_step=0.25, adapt_tolerance=0.1, **overrides)
    return AdmissionTuner(config, weight=config.acting_overbook)


def weights_after(law: AdmissionTuner, windows: list[tuple[float, float, bool]]) -> list[float]:
    """Each window: (steps per second, utilisation, whether requests waited)."""
    now, steps, weights = 0.0, 0, []
    law.observe(now, steps, 1.0, False)
    for rate, utilization, waited in windows:
        now += WINDOW_S
        steps += round(rate * WINDOW_S)
        weights.append(law.observe(now, steps, utilization, waited))
    return weights


BUSY, IDLE = 1.0, 0.3


@pytest.mark.parametrize(
    ("windows", "expected"),
    [
        pytest.param([(10, BUSY, False)] * 3, [1.0, 1.0, 1.0], id="nobody waits: held at full protection"),
        pytest.param([(10, IDLE, True)] * 2, [0.75, 0.5], id="engines idle while requests wait: admit more"),
        pytest.param([(10, BUSY, True)], [0.75], id="first busy window with waiting: try more admission"),
        pytest.param([(10, BUSY, True), (12, BUSY, True), (14, BUSY, True)], [0.75, 0.5, 0.25], id="steps/s rise: go on"),
        pytest.param([(10, BUSY, True), (8, BUSY, True)], [0.75, 1.0], id="steps/s fall: turn back"),
        pytest.param([(10, BUSY, True), (10.5, BUSY, True)], [0.75, 1.0], id="steps/s level: back to protection"),
        pytest.param([(10, BUSY, True), (8, BUSY, True), (8, BUSY, True), (8.2, BUSY, True)], [0.75, 1.0, 1.0, 1.0], id="full protection holds while level"),
        pytest.param([(10, BUSY, True), (10, BUSY, False), (5, BUSY, True)], [0.75, 0.75, 0.5], id="a window without waiting restarts the comparison"),
        pytest.param([(10, IDLE, True), (12, BUSY, True), (10, BUSY, True)], [0.75, 0.5, 0.75], id="after an idle cut the next busy window compares afresh"),
    ],
)
def test_admission_law(windows, expected) -> None:
    assert weights_after(tuner(), windows) == pytest.approx(expected)


def test_weight_never_goes_below_the_floor() -> None:
    assert weights_after(tuner(acting_weight_min=0.5), [(10, IDLE, True)] * 4)[-1] == 0.5


def test_weight_never_exceeds_the_configured_ceiling() -> None:
    law = tuner(acting_overbook=0.8)
    assert max(weights_after(law, [(10, BUSY, True), (5, BUSY, True), (5, BUSY, True)])) <= 0.8


def test_nothing_moves_before_a_window_has_passed() -> None:
    law = tuner()
    law.observe(0.0, 0, BUSY, True)
    assert law.observe(WINDOW_S / 2, 50, BUSY, True) == 1.0
