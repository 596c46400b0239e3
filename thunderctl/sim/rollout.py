"""An RL rollout batch in virtual time: N tasks × G samples (a GRPO group per task), all started at 0.

The samples of one task are the task's program with their own answers: the same first prompt
(the task), then per sample, drawn from a generator seeded by (seed, program index), a step count,
answer lengths, new input per step and tool times around the task's own. A training step waits for
the batch's last program, so the figures are the batch's: its makespan, and when the median group
and the last group finished (a group finishes with its last sample).
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from thunderctl.sim.agents import AgentProgram, ProgramRun, Workload

# Log-space sigmas of a sample's variation around its task: a sample's step count, each answer's
# length, each step's new input and each tool time is the task's times e^N(0, sigma).
STEPS_SIGMA = 0.3
ANSWER_SIGMA = 0.3
INPUT_SIGMA = 0.3
TOOL_SIGMA = 0.5


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


def _factor(rng: random.Random, sigma: float) -> float:
    return math.exp(rng.gauss(0.0, sigma))


def sample_of(task: AgentProgram, rng: random.Random) -> SampleProgram:
    """One sample of a task: its first prompt, then steps shaped like the task's, drawn from `rng`.
    Past the task's own step count a step is shaped like a random one of the task's."""
    steps = list(task.steps)
    count = max(1, round(len(steps) * _factor(rng, STEPS_SIGMA)))
    # What each of the task's steps adds to the next prompt besides its answer (an observation).
    inputs = [max(1, b.prompt_tokens - a.prompt_tokens - a.completion_tokens) for a, b in zip(steps, steps[1:])]
    prompt, drawn = steps[0].prompt_tokens, []
    for k in range(count):
        shape = steps[k] if k < len(steps) else rng.choice(steps)
        answer = max(1, round(shape.completion_tokens * _factor(rng, ANSWER_SIGMA)))
        last = k == count - 1
        tool_s = 0.0 if last else max(shape.tool_s, 0.01) * _factor(rng, TOOL_SIGMA)
        drawn.append(SampleStep(prompt, answer, tool_s))
        grown = inputs[k] if k < len(inputs) else rng.choice(inputs or [1])
        prompt += answer + max(1, round(grown * _factor(rng, INPUT_SIGMA)))
    return SampleProgram(tuple(drawn), task.env_prep_s)


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
        task = self.tasks.program(seed, index // self.samples)
        return sample_of(task, random.Random(f"rollout/{seed}/{index}"))


def group_finishes(completed: Sequence[ProgramRun], samples: int) -> list[float]:
    """When each group whose samples all ended finished (its last sample's answer), earliest first."""
    ends: dict[int, list[float]] = {}
    for run in completed:
        ends.setdefault(run.program_index // samples, []).append(run.done_s)
    return sorted(max(done) for done in ends.values() if len(done) == samples)


def batch_figures(completed: Sequence[ProgramRun], rollout: Rollout) -> dict[str, Any]:
    """The batch's makespan (None unless every program ended), and the median and last group's finish."""
    finishes = group_finishes(completed, rollout.samples)
    whole = len(finishes) == rollout.tasks
    median = statistics.median_low(finishes) if whole else None
    last = finishes[-1] if whole else None
    return {
        "makespan_s": max(run.done_s for run in completed) if whole else None,
        "group_median_s": median,
        "group_last_s": last,
        "group_last_to_median": last / median if last is not None and median else None,
        "groups_done": len(finishes),
        "groups": rollout.tasks,
    }
