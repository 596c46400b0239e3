"""An RL rollout batch: N tasks × G samples (a GRPO group per task), all started at 0, and its figures.

The one definition of a batch's samples and of its group figures: the simulator's batch
(`bench simulate --rollout`, in virtual time) and `bench rollout`'s (on real engines) both draw
their samples and count their groups here, so that the same seed gives the same batch in both and
their figures mean the same. The samples of one task share its first prompt (the task), then
each, drawn from a generator seeded by (seed, task, sample), has its own step count, answer
lengths and tool times around the task's. A training step waits for the batch's last program, so
the figures are the batch's: its makespan, and when the median group and the last group finished
(a group finishes with its last sample).
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from thunderctl.sim.agents import AgentProgram, ProgramRun, Workload, steps_that_fit
from thunderctl.sim.cost import Preset

# How far a sample strays from its task's run: each quantity is multiplied by a lognormal factor
# of median 1 and this log-space sigma. Samples of one task at a temperature answer at lengths
# that differ by about half, and end after a number of steps that differs by a third.
STEPS_SIGMA = 0.3
ANSWER_SIGMA = 0.5
TOOL_SIGMA = 0.5
# The most a simulated batch may take: one not over by then has no makespan.
BATCH_MAX_S = 6 * 3600.0


@dataclass(frozen=True)
class Rollout:
    """N tasks × G samples: `thunderctl bench simulate --rollout NxG`."""

    tasks: int
    samples: int

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.samples < 1:
            raise ValueError(f"a rollout needs at least 1 task and 1 sample, got {self.tasks}x{self.samples}")

    @property
    def programs(self) -> int:
        return self.tasks * self.samples

    @classmethod
    def parse(cls, text: str) -> Rollout:
        found = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
        if found is None:
            raise ValueError(f"--rollout takes TASKSxSAMPLES, e.g. 32x8 (32 tasks of 8 samples), not {text!r}")
        return cls(int(found[1]), int(found[2]))

    def __str__(self) -> str:
        return f"{self.tasks}x{self.samples}"


@dataclass(frozen=True)
class SampleStep:
    prompt_tokens: int
    completion_tokens: int
    tool_s: float


@dataclass(frozen=True)
class SampleProgram:
    steps: tuple[SampleStep, ...]
    env_prep_s: float | None = None


def sample_of(task: AgentProgram, rng: random.Random) -> SampleProgram:
    """One sample of `task`: the same first prompt, then answers, tool times and a step count of
    its own. Step k follows the task's step at the same share of the run, so a sample that runs
    longer stretches the task's run and one that ends sooner skips through it, each ending as the
    task ends; what each step adds besides its answer (the observation) is the task's step's."""
    base = list(task.steps)
    n_steps = max(1, round(len(base) * rng.lognormvariate(0.0, STEPS_SIGMA)))
    observations = [max(1, b.prompt_tokens - a.prompt_tokens - a.completion_tokens) for a, b in pairwise(base)] or [1]
    tools = [step.tool_s for step in base[:-1]] or [0.0]
    prompt, steps = base[0].prompt_tokens, []
    for k in range(n_steps):
        at = k * len(base) // n_steps
        completion = max(1, round(base[at].completion_tokens * rng.lognormvariate(0.0, ANSWER_SIGMA)))
        last = k == n_steps - 1
        tool_s = 0.0 if last else tools[min(at, len(tools) - 1)] * rng.lognormvariate(0.0, TOOL_SIGMA)
        steps.append(SampleStep(prompt, completion, tool_s))
        prompt += completion + observations[min(at, len(observations) - 1)]
    return SampleProgram(tuple(steps), task.env_prep_s)


def sample_in_batch(task: AgentProgram, seed: int, index: int, samples: int) -> SampleProgram:
    """Program `index` of a batch of `samples` samples per task: sample `index % samples` of its
    task, drawn from a generator of its own, so that every run of the batch draws the same."""
    group, sample = divmod(index, samples)
    return sample_of(task, random.Random(f"rollout/{seed}/{group}/{sample}"))


@dataclass(frozen=True)
class SampledWorkload:
    """A workload's programs as the tasks of a rollout: program `index` is sample index % G of task
    index // G (the workload's program of that index)."""

    tasks: Workload
    samples: int

    @property
    def system_prompt_tokens(self) -> int:
        return self.tasks.system_prompt_tokens

    @property
    def max_context_tokens(self) -> int | None:
        return self.tasks.max_context_tokens

    def program(self, seed: int, index: int) -> SampleProgram:
        return sample_in_batch(self.tasks.program(seed, index // self.samples), seed, index, self.samples)


@dataclass(frozen=True)
class GroupFigures:
    """When a batch's groups finished, from its start; a group finishes with its last sample's last answer."""

    median_s: float | None  # the median group's finish; None while it is unknown (half the groups or more unfinished)
    last_s: float | None  # the last group's; None unless every group finished
    done: int  # groups whose every sample finished
    groups: int

    @classmethod
    def of(cls, finished: Iterable[tuple[int, float]], rollout: Rollout) -> GroupFigures:
        """From (program index, its last answer) of each program that finished. The median is over
        all the batch's groups, an unfinished one counted as finishing last: the median of the
        finished ones alone would flatter a batch whose slow groups never ended."""
        ends: dict[int, list[float]] = {}
        for index, end_s in finished:
            ends.setdefault(index // rollout.samples, []).append(end_s)
        finishes = sorted(max(done) for done in ends.values() if len(done) == rollout.samples)
        median = statistics.median([*finishes, *[math.inf] * (rollout.tasks - len(finishes))])
        whole = len(finishes) == rollout.tasks
        return cls(
            median_s=None if math.isinf(median) else median,
            last_s=finishes[-1] if whole and finishes else None,
            done=len(finishes),
            groups=rollout.tasks,
        )


@dataclass(frozen=True)
class CriticalPath:
    """A batch's longest program run alone, each answer as soon as its prompt is sent and each
    prompt as soon as its tool ends: no scheduler ends the batch sooner."""

    seconds: float
    program_index: int
    steps: int


def alone_seconds(program: AgentProgram, preset: Preset, max_context_tokens: int | None) -> float:
    """A program on an engine of its own: its environment's preparation, then each step's request
    alone (`Preset.alone_seconds`) and its tool. Each prompt finds the previous prompt and answer
    cached, whole blocks of them as the engine keeps them; the first finds nothing (at the batch's
    start no cache holds anything), unless the program prepared an environment first, during
    which others may have computed its first prompt: it is then counted as cached."""
    block = preset.engine.block_size
    steps = steps_that_fit(program.steps, max_context_tokens)
    prepare_s = program.env_prep_s or 0.0
    seconds, held = prepare_s, (steps[0].prompt_tokens if prepare_s > 0 else 0)
    for step in steps:
        answer = max(1, step.completion_tokens)
        cached = min(held - 1, step.prompt_tokens - 1) // block * block if held else 0
        seconds += preset.alone_seconds(step.prompt_tokens, cached, answer)
        held = step.prompt_tokens + answer
    return seconds + sum(step.tool_s for step in steps[:-1])


def critical_path(workload: Workload, seed: int, rollout: Rollout, preset: Preset) -> CriticalPath:
    """The batch's longest program alone on one of `preset`'s engines (`alone_seconds`)."""
    sampled = SampledWorkload(workload, rollout.samples)
    times = [
        (alone_seconds(sampled.program(seed, index), preset, sampled.max_context_tokens), index)
        for index in range(rollout.programs)
    ]
    seconds, index = max(times)
    steps = steps_that_fit(sampled.program(seed, index).steps, sampled.max_context_tokens)
    return CriticalPath(seconds, index, len(steps))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator ÷ denominator, None when either is unknown (or the denominator 0)."""
    return numerator / denominator if numerator is not None and denominator else None


def critical_figures(makespan_s: float | None, path_s: float | None) -> dict[str, float | None]:
    """The critical path beside the makespan: how far above the bound the batch ended."""
    return {"critical_path_s": path_s, "makespan_to_critical_path": ratio(makespan_s, path_s)}


def batch_figures(completed: Sequence[ProgramRun], rollout: Rollout) -> dict[str, Any]:
    """The batch's makespan (None unless every program ended), and the median and last group's finish."""
    groups = GroupFigures.of(((run.program_index, run.done_s) for run in completed), rollout)
    median, last = groups.median_s, groups.last_s
    return {
        "makespan_s": max(run.done_s for run in completed) if last is not None else None,
        "group_median_s": median,
        "group_last_s": last,
        "group_last_to_median": ratio(last, median),
        "groups_done": groups.done,
        "groups": groups.groups,
    }
