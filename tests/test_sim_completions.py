"""Whole-program completion times from a run that ends with programs still running."""

from __future__ import annotations

import pytest

from thunderctl.sim.agents import ProgramRun
from thunderctl.sim.completions import program_figures, survival_quantiles


@pytest.mark.parametrize(
    ("ended", "running", "quantiles"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [], [5, 9]),  # nothing running: the plain quantiles
        ([1, 2, 3, 4], [2.5], [3, 4]),  # one running since 2.5 s is longer than the median of the rest (2.5)
        ([1, 2, 3], [10, 10, 10, 10, 10, 10, 10], [None, None]),  # most still running: beyond the run
        ([5, 6], [1, 1, 1, 1, 1, 1, 1, 1], [5, 6]),  # just started: they tell nothing of the tail
        ([], [], [None, None]),
    ],
)
def test_programs_still_running_count_as_lasting_at_least_until_the_end(
    ended: list[float], running: list[float], quantiles: list[float | None]
) -> None:
    assert survival_quantiles(ended, running, (0.5, 0.9)) == quantiles


def test_programs_per_minute_counts_those_that_ended_in_the_window_and_their_steps() -> None:
    completed = [ProgramRun(0, 0.0, 50.0, 3), ProgramRun(1, 10.0, 130.0, 5), ProgramRun(2, 20.0, 170.0, 4)]
    sent = {0: 0.0, 1: 10.0, 2: 20.0, 3: 100.0}  # program 3 runs past the end
    figures = program_figures(completed, sent, start_s=60.0, end_s=180.0)
    assert (figures["programs_done"], figures["program_steps"], figures["programs_running"]) == (2, 9, 1)
    assert figures["programs_per_min"] == 1.0
    assert figures["program_p50_s"] == 120.0  # of 50, 120, 150 and one at least 80
