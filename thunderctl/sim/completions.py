"""Whole programs of a simulated run: how long a task took from its first request to its last answer.

Step latency is the wrong yardstick for a scheduler that pauses programs: it may make some steps
wait so that whole programs finish sooner. Users wait for tasks, so every arm reports these too.

A run of fixed length ends with programs still running, and those are the long ones: the
percentiles of the programs that ended alone flatter an arm that ends few (sticky at 256
programs ends a fifth as many as the policies, all short). So the percentiles are the
product-limit (Kaplan–Meier) estimate over every program that started from step 0, one still
running counted as lasting at least until the run's end; a percentile the run is too short to
reach is None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from thunderctl.sim.agents import ProgramRun


def survival_quantiles(ended: Sequence[float], running: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    """Quantiles of a duration of which `ended` were seen whole and `running` only up to a point
    (each lasted at least that long): the product-limit estimate."""
    events = sorted([(t, True) for t in ended] + [(t, False) for t in running], key=lambda e: (e[0], not e[1]))
    at_risk, surviving = len(events), 1.0
    crossings: list[float | None] = [None] * len(qs)
    for t, ended_here in events:
        if ended_here:
            surviving *= 1 - 1 / at_risk
            for k, q in enumerate(qs):
                if crossings[k] is None and 1 - surviving >= q - 1e-12:
                    crossings[k] = t
        at_risk -= 1
    return crossings


def program_figures(
    completed: Sequence[ProgramRun], sent: Mapping[int, float], start_s: float, end_s: float
) -> dict[str, Any]:
    """Completion time p50, p90 and p99 (product-limit over every program sent by `end_s`), and
    the programs whose last answer came in [start_s, end_s]: per minute, and the steps they made."""
    ended = {run.program_index: run for run in completed if run.done_s <= end_s}
    running = [end_s - t for index, t in sent.items() if index not in ended and t <= end_s]
    p50, p90, p99 = survival_quantiles([run.completion_s for run in ended.values()], running, (0.5, 0.9, 0.99))
    done = [run for run in ended.values() if run.done_s >= start_s]
    window_min = (end_s - start_s) / 60.0
    return {
        "program_p50_s": p50,
        "program_p90_s": p90,
        "program_p99_s": p99,
        "programs_per_min": len(done) / window_min if window_min > 0 else None,
        "programs_done": len(done),
        "programs_running": len(running),
        "program_steps": sum(run.steps for run in done),
    }


def makespan(completed: Sequence[ProgramRun], programs: int) -> float | None:
    """When the last of the first `programs` programs (by index) answered, measured from 0;
    None while one of them has not ended: a batch's time to finish."""
    ends = {run.program_index: run.done_s for run in completed if run.program_index < programs}
    return max(ends.values()) if len(ends) == programs else None
