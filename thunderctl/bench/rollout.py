"""RL rollout batches: N tasks × G samples (GRPO groups) started at once, and the batch's makespan.

In RL a training step waits for its batch's last program, so what counts is when the batch ends,
not steps per minute. A batch's programs are the samples of its tasks: the samples of one task
share its first prompt, then each goes its own way (its own answers, tool times and step count,
drawn from a seed around the task's recorded run). `bench rollout` runs batches through the
cluster and straight to the engines with the closed-loop driver (closed_loop.py), every program
of a batch in a slot of its own; this module is the batch (a workload) and its figures.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from thunderctl.bench.replay import ArmOutcome, TraceWorkload
from thunderctl.bench.results import LoadResult
from thunderctl.traceformat import TraceProgram, TraceStep

# How far a sample strays from its task's recorded run: each quantity is multiplied by a lognormal
# factor of median 1 and this log-space sigma. Samples of one task at a temperature answer at
# lengths that differ by about half, and end after a number of steps that differs by a third.
STEPS_SIGMA = 0.3
ANSWER_SIGMA = 0.5
TOOL_SIGMA = 0.5


def cut(program: TraceProgram, max_steps: int | None) -> TraceProgram:
    """The program's first `max_steps` steps, the last of them calling no tool."""
    if max_steps is None or len(program.steps) <= max_steps:
        return program
    kept = list(program.steps[:max_steps])
    kept[-1] = kept[-1].model_copy(update={"tool_s": 0.0})
    return program.model_copy(update={"steps": tuple(kept)})


def sample_of(task: TraceProgram, rng: random.Random, sample_id: str) -> TraceProgram:
    """One sample of `task`: the same first prompt, then answers, tool times and a step count of
    its own. Step k follows the recorded step at the same share of the run, so a sample that runs
    longer stretches the task's run and one that ends sooner skips through it; what each step adds
    besides its answer (the observation) is the recorded step's."""
    base = task.steps
    n_steps = max(1, round(len(base) * rng.lognormvariate(0.0, STEPS_SIGMA)))
    observations = [max(1, b.prompt_tokens - a.prompt_tokens - a.completion_tokens) for a, b in pairwise(base)] or [1]
    tools = [step.tool_s for step in base[:-1]] or [0.0]
    prompt = base[0].prompt_tokens
    steps = []
    for k in range(n_steps):
        at = k * len(base) // n_steps
        completion = max(1, round(base[at].completion_tokens * rng.lognormvariate(0.0, ANSWER_SIGMA)))
        last = k == n_steps - 1
        tool_s = 0.0 if last else tools[min(at, len(tools) - 1)] * rng.lognormvariate(0.0, TOOL_SIGMA)
        steps.append(TraceStep(prompt_tokens=prompt, completion_tokens=completion, tool_s=tool_s))
        prompt += completion + observations[min(at, len(observations) - 1)]
    return task.model_copy(update={"id": sample_id, "steps": tuple(steps)})


@dataclass(frozen=True, kw_only=True)
class RolloutBatch(TraceWorkload):
    """A trace (the recorded runs by default) as rollout batches: program `index` is sample
    `index % samples` of task `index // samples`, and task k of seed s is the trace's program k
    of that seed's shuffle, cut to `max_steps`. Satisfies closed_loop's Workload."""

    samples: int = 1
    max_steps: int | None = None
    name: str = "rollout"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples < 1:
            raise ValueError(f"a task needs at least one sample, got {self.samples}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {self.max_steps}")

    def program(self, seed: int, index: int) -> TraceProgram:
        task, sample = divmod(index, self.samples)
        recorded = cut(super().program(seed, task), self.max_steps)
        rng = random.Random(f"rollout/{seed}/{task}/{sample}")
        return sample_of(recorded, rng, f"{recorded.id}-s{sample}")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "samples": self.samples, "max_steps": self.max_steps}


# --- figures ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchFigures:
    """One batch in one arm. Times are from the batch's start (every program sent at once)."""

    arm: str
    batch: int
    programs: int
    programs_completed: int
    last_answer_s: float  # the last answer of any program of the batch
    # The last program's last answer: what the training step waits for. None when a program of
    # the batch did not complete (a request failed), as the simulator reports it.
    makespan_s: float | None
    median_group_s: float | None  # when the median group's last sample answered (completed groups only)
    last_group_s: float | None  # the last group's; None unless every group completed
    programs_per_min: float | None  # completed programs per minute of the batch's time
    hit_rate: float | None  # prefix-cache hits ÷ queries on the engines over the batch
    failed_requests: int
    resent_requests: int  # sent again after no byte of an answer came (a refused or timed-out connection)
    preemptions: int
    steps: int  # requests answered


def batch_figures(arm: str, batch: int, result: LoadResult, programs: int, samples: int) -> BatchFigures:
    """The batch's figures from one closed-loop run of its `programs` (tasks × `samples`)."""
    index_of = {record.program_id: record.program_index for record in result.records}
    ends: dict[int, list[float]] = {}
    for run in result.program_runs:
        ends.setdefault(index_of[run.program_id] // samples, []).append(run.end_s)
    groups = [max(finished) for finished in ends.values() if len(finished) == samples]
    complete = result.programs_completed == programs
    last_answer = max((record.end_s for record in result.records), default=0.0)
    return BatchFigures(
        arm=arm,
        batch=batch,
        programs=programs,
        programs_completed=result.programs_completed,
        last_answer_s=last_answer,
        makespan_s=last_answer if complete else None,
        median_group_s=statistics.median(groups) if groups else None,
        last_group_s=max(groups) if complete and groups else None,
        programs_per_min=60.0 * result.programs_completed / last_answer if last_answer > 0 else None,
        hit_rate=result.engines.hit_rate,
        failed_requests=result.steps_failed,
        resent_requests=result.unanswered_retries,
        preemptions=result.engines.preemptions,
        steps=result.steps_ok,
    )


def mean_of(values: Sequence[float | None]) -> float | None:
    """The mean, or None when any value is missing (a figure of an incomplete batch)."""
    if not values or any(value is None for value in values):
        return None
    return statistics.fmean(value for value in values if value is not None)


def arm_figures(batches: Sequence[BatchFigures], outcome: ArmOutcome) -> dict[str, Any]:
    """The arm over its batches: the batch times' means, counts summed, programs per minute and
    the hit rate over all its batches."""
    combined = outcome.combined()
    busy_s = sum(b.last_answer_s for b in batches)
    return {
        "batches": len(batches),
        "makespan_s": mean_of([b.makespan_s for b in batches]),
        "median_group_s": mean_of([b.median_group_s for b in batches]),
        "last_group_s": mean_of([b.last_group_s for b in batches]),
        "programs_per_min": 60.0 * sum(b.programs_completed for b in batches) / busy_s if busy_s > 0 else None,
        "hit_rate": combined.engines.hit_rate,
        "programs": sum(b.programs for b in batches),
        "programs_completed": sum(b.programs_completed for b in batches),
        "failed_requests": sum(b.failed_requests for b in batches),
        "resent_requests": sum(b.resent_requests for b in batches),
        "preemptions": sum(b.preemptions for b in batches),
        "step_errors": combined.step_errors,
        "resend_errors": dict(Counter(resend.error[:160] for resend in combined.resends).most_common()),
        "warnings": outcome.warnings,
    }


def rollout_report(
    workload: dict[str, Any], parameters: dict[str, Any], outcomes: dict[str, ArmOutcome], wall_s: float
) -> dict[str, Any]:
    """The JSON report: every batch of every arm, each arm over its batches, and cluster ÷ direct."""
    programs = parameters["tasks"] * parameters["samples"]
    batches = {
        name: [
            batch_figures(name, k, result, programs, parameters["samples"]) for k, result in enumerate(outcome.slices)
        ]
        for name, outcome in outcomes.items()
    }
    arms = {name: arm_figures(batches[name], outcome) for name, outcome in outcomes.items()}
    return {
        "benchmark": "rollout",
        "wall_s": wall_s,
        "workload": workload,
        "parameters": parameters,
        "batches": [asdict(figures) for name in batches for figures in batches[name]],
        "arms": arms,
        "ratios": rollout_ratios(arms),
    }


def rollout_ratios(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Cluster ÷ direct for the batch times (below 1: thunderctl ends batches sooner) and programs/min."""
    if "cluster" not in arms or "direct" not in arms:
        return {}
    cluster, direct = arms["cluster"], arms["direct"]
    figures = ("makespan_s", "median_group_s", "last_group_s", "programs_per_min")
    return {
        figure: cluster[figure] / direct[figure] if cluster[figure] is not None and direct[figure] else None
        for figure in figures
    }
