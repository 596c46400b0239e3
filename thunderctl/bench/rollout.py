"""RL rollout batches: N tasks × G samples (GRPO groups) started at once, and the batch's makespan.

In RL a training step waits for its batch's last program, so what counts is when the batch ends,
not steps per minute. A batch's programs are the samples of its tasks: the samples of one task
share its first prompt, then each goes its own way (its own answers, tool times and step count,
drawn from a seed around the task's recorded run by sim/rollout.py, as the simulator's batch is).
`bench rollout` runs batches through the cluster and straight to the engines with the
closed-loop driver (closed_loop.py), every program of a batch in a slot of its own; this module
is the batch (a workload) and its figures.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from thunderctl.bench.replay import ArmOutcome, TraceWorkload
from thunderctl.bench.results import LoadResult, StepRecord
from thunderctl.sim.rollout import GroupFigures, Rollout, critical_figures, ratio, sample_in_batch
from thunderctl.traceformat import TraceProgram, TraceStep


def cut(program: TraceProgram, max_steps: int | None) -> TraceProgram:
    """The program's first `max_steps` steps, the last of them calling no tool."""
    if max_steps is None or len(program.steps) <= max_steps:
        return program
    kept = list(program.steps[:max_steps])
    kept[-1] = kept[-1].model_copy(update={"tool_s": 0.0})
    return program.model_copy(update={"steps": tuple(kept)})


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
        recorded = cut(super().program(seed, index // self.samples), self.max_steps)
        drawn = sample_in_batch(recorded, seed, index, self.samples)
        steps = tuple(TraceStep(**asdict(step)) for step in drawn.steps)
        return recorded.model_copy(update={"id": f"{recorded.id}-s{index % self.samples}", "steps": steps})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "samples": self.samples, "max_steps": self.max_steps}


# --- figures ---------------------------------------------------------------------------

# Only answers of at least this many tokens give a pace per token: a shorter one's time is
# mostly its first token's, and would price every token as a first token.
PACE_MIN_TOKENS = 16


def pace_s(record: StepRecord) -> float | None:
    """An answer's time per token after its first (per token, unstreamed); None for a failed or
    short one."""
    tokens = record.completion_tokens
    if not record.ok or tokens is None or tokens < PACE_MIN_TOKENS:
        return None
    if record.ttft_s is not None:
        return (record.latency_s - record.ttft_s) / (tokens - 1)
    return record.latency_s / tokens


@dataclass(frozen=True)
class FastestService:
    """The engines' fastest service seen in a batch, the pace of a request alone: at a batch's
    tail few programs are left, so its last answers come at nearly the uncontended rate, and the
    fastest of all is no slower than that."""

    first_token_s: float | None  # the lowest time to first token of any answer (streamed batches)
    # The lowest time per answer token after the first (streamed), or per answer token (not)
    per_token_s: float | None

    @classmethod
    def of(cls, records: Sequence[StepRecord]) -> FastestService:
        firsts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
        paces = [pace for r in records if (pace := pace_s(r)) is not None]
        return cls(min(firsts, default=None), min(paces, default=None))

    def step_s(self, record: StepRecord) -> float:
        """A step's answer at this pace (its first token at the fastest first token's), never
        longer than it took: its own latency less what it waited and what contention slowed."""
        tokens = record.completion_tokens
        if tokens is None or self.per_token_s is None:
            return record.latency_s
        if record.ttft_s is not None and self.first_token_s is not None:
            alone = self.first_token_s + (tokens - 1) * self.per_token_s
        else:
            alone = tokens * self.per_token_s
        return min(record.latency_s, alone)


def measured_critical_path(result: LoadResult) -> float | None:
    """The batch's longest completed program with its waits taken out: from the batch's start to
    its first request (its environment's preparation), then each step at the batch's fastest
    service (`FastestService.step_s`) and each gap between an answer and the next request (its
    tool) as measured. A program is never faster than its own steps at that pace, so the makespan
    is at least this; None when no program completed."""
    pace = FastestService.of(result.records)
    completed = {run.program_id for run in result.program_runs}
    steps: dict[str, list[StepRecord]] = {}
    for record in result.records:
        if record.program_id in completed:
            steps.setdefault(record.program_id, []).append(record)
    paths = []
    for records in steps.values():
        records.sort(key=lambda r: r.step)
        tools = sum(b.start_s - a.end_s for a, b in pairwise(records))
        paths.append(records[0].start_s + sum(pace.step_s(r) for r in records) + tools)
    return max(paths, default=None)


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
    # When the median group's last sample answered, over all the batch's groups (GroupFigures).
    group_median_s: float | None
    group_last_s: float | None  # the last group's; None unless every group completed
    group_last_to_median: float | None
    critical_path_s: float | None  # measured_critical_path
    makespan_to_critical_path: float | None
    programs_per_min: float | None  # completed programs per minute of the batch's time
    hit_rate: float | None  # prefix-cache hits ÷ queries on the engines over the batch
    failed_requests: int
    resent_requests: int  # sent again after no byte of an answer came (a refused or timed-out connection)
    preemptions: int
    steps: int  # requests answered


def batch_figures(arm: str, batch: int, result: LoadResult, programs: int, samples: int) -> BatchFigures:
    """The batch's figures from one closed-loop run of its `programs` (tasks × `samples`)."""
    index_of = {record.program_id: record.program_index for record in result.records}
    finished = ((index_of[run.program_id], run.end_s) for run in result.program_runs)
    groups = GroupFigures.of(finished, Rollout(programs // samples, samples))
    complete = result.programs_completed == programs
    last_answer = max((record.end_s for record in result.records), default=0.0)
    makespan = last_answer if complete else None
    return BatchFigures(
        arm=arm,
        batch=batch,
        programs=programs,
        programs_completed=result.programs_completed,
        last_answer_s=last_answer,
        makespan_s=makespan,
        group_median_s=groups.median_s,
        group_last_s=groups.last_s,
        group_last_to_median=ratio(groups.last_s, groups.median_s),
        **critical_figures(makespan, measured_critical_path(result)),
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
    """The arm over its batches: the batch times' and their ratios' means, counts summed, programs
    per minute and the hit rate over all its batches."""
    combined = outcome.combined()
    busy_s = sum(b.last_answer_s for b in batches)
    return {
        "batches": len(batches),
        "makespan_s": mean_of([b.makespan_s for b in batches]),
        "group_median_s": mean_of([b.group_median_s for b in batches]),
        "group_last_s": mean_of([b.group_last_s for b in batches]),
        "group_last_to_median": mean_of([b.group_last_to_median for b in batches]),
        "critical_path_s": mean_of([b.critical_path_s for b in batches]),
        "makespan_to_critical_path": mean_of([b.makespan_to_critical_path for b in batches]),
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
    figures = ("makespan_s", "group_median_s", "group_last_s", "programs_per_min")
    return {
        figure: cluster[figure] / direct[figure] if cluster[figure] is not None and direct[figure] else None
        for figure in figures
    }
