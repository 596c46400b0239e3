"""Workloads of agent programs: what a closed-loop load runs, and `AgentShape`'s uniform ranges."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from thunderctl.traceformat import TraceProgram, TraceStep

# Chat-template tokens around each message (role markers, separators), for context estimates.
MESSAGE_OVERHEAD_TOKENS = 8


@dataclass(frozen=True)
class Uniform:
    """A uniform range; `Uniform(x, x)` is a constant."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if self.low > self.high or self.low < 0:
            raise ValueError(f"Uniform needs 0 <= low <= high, got [{self.low}, {self.high}]")

    def draw(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def draw_int(self, rng: random.Random) -> int:
        low, high = math.ceil(self.low), math.floor(self.high)
        # A range narrower than one integer, like [2.2, 2.8], still has a nearest value.
        return rng.randint(low, high) if low <= high else round(self.low)


class Workload(Protocol):
    """The programs a load runs, each drawn (or looked up) by seed and index alone."""

    @property
    def system_prompt_tokens(self) -> int:
        """The prefix every program of a run shares."""
        ...

    @property
    def max_context_tokens(self) -> int | None:
        """A program ends early rather than send a prompt the engine would reject."""
        ...

    def program(self, seed: int, index: int) -> TraceProgram: ...


@dataclass(frozen=True)
class AgentShape:
    """Agent programs drawn from uniform ranges. Token counts are engine tokens.

    The first prompt is the shared system prompt plus the program's task; each step then
    adds the assistant's answer (`completion_tokens`) and a tool observation.
    """

    system_prompt_tokens: int = 1000
    task_tokens: Uniform = Uniform(300, 800)
    observation_tokens: Uniform = Uniform(150, 500)
    completion_tokens: Uniform = Uniform(30, 100)
    steps: Uniform = Uniform(8, 16)
    tool_seconds: Uniform = Uniform(0.5, 3.0)
    max_context_tokens: int | None = None

    def program(self, seed: int, index: int) -> TraceProgram:
        rng = random.Random(f"{seed}/program/{index}")
        n_steps = max(1, self.steps.draw_int(rng))
        prompt = self.system_prompt_tokens + self.task_tokens.draw_int(rng) + 2 * MESSAGE_OVERHEAD_TOKENS
        steps = []
        for _ in range(n_steps):
            completion = max(1, self.completion_tokens.draw_int(rng))
            observation = self.observation_tokens.draw_int(rng)
            steps.append(
                TraceStep(prompt_tokens=prompt, completion_tokens=completion, tool_s=self.tool_seconds.draw(rng))
            )
            prompt += completion + observation + 2 * MESSAGE_OVERHEAD_TOKENS
        return TraceProgram(id=f"shape-{seed}-{index}", steps=tuple(steps))
