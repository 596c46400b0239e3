"""Whole programs of a simulated run: how long a task took from its first request to its last answer.

Step latency is the wrong yardstick for a scheduler that pauses programs: it may make some steps
wait so that whole programs finish sooner. Users wait for tasks, so every arm reports these too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thunderctl.sim.agents import ProgramRun
from thunderctl.sim.waits import percentile


def program_figures(completed: Sequence[ProgramRun], start_s: float, end_s: float) -> dict[str, Any]:
    """The programs whose last answer came in [start_s, end_s]: their completion time's p50, p90
    and p99, how many finished per minute of the window, and the steps they made.

    A run of fixed length sees short programs end more often than long ones (a long one that
    starts late has no time to end), so these figures describe the programs that finished;
    compare arms on the same programs and window, as every sweep does.
    """
    done = [run for run in completed if start_s <= run.done_s <= end_s]
    times = [run.completion_s for run in done]
    window_min = (end_s - start_s) / 60.0
    return {
        "program_p50_s": percentile(times, 50),
        "program_p90_s": percentile(times, 90),
        "program_p99_s": percentile(times, 99),
        "programs_per_min": len(done) / window_min if window_min > 0 else None,
        "programs_done": len(done),
        "program_steps": sum(run.steps for run in done),
    }


def makespan(completed: Sequence[ProgramRun], programs: int) -> float | None:
    """When the last of the first `programs` programs (by index) answered, measured from 0;
    None while one of them has not ended: a batch's time to finish."""
    ends = {run.program_index: run.done_s for run in completed if run.program_index < programs}
    return max(ends.values()) if len(ends) == programs else None
