"""`--workload long-tail`: seeded programs shaped like OpenHands runs, long and with heavy-tailed tools.

Where `swe-lite` programs (mini-swe-agent) end at ~20k tokens after ~36 steps with tools of
seconds, an OpenHands-style agent carries a large system prompt with its tool schemas, reads
whole files and test logs into its context, runs 30–90 steps, grows to about 100k tokens, and
now and then waits minutes for a build or a test suite. The shape (an assumption, not a fit to
published runs; docs/sim-arms.md, "Workloads"):

- steps: uniform over 30–90;
- first prompt: a shared system prompt of 5,000 tokens plus a task of median 600;
- final context: lognormal, median 64k, capped at 100k; each step's new input is the program's
  growth split by lognormal weights (σ 1), so some steps read a whole file and most add little;
- answers: median 150 tokens, mean 300;
- tool times: lognormal, median 4 s, σ 1.5 (p90 27 s, p99 130 s), capped at 900 s.

Every draw comes from a generator seeded by (seed, program index), so a program is the same in
every arm and every run; `scale` multiplies every token count and keeps the shape.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from thunderctl.bench.swe_lite import LogNormal, SweLite
from thunderctl.traceformat import TraceProgram, TraceStep

SYSTEM_PROMPT_TOKENS = 5_000
STEPS = (30, 90)
TASK_TOKENS = LogNormal(median=600, sigma=0.8, cap=8_192)
FINAL_CONTEXT_TOKENS = LogNormal(median=64_000, sigma=0.4, cap=100_000)
COMPLETION_TOKENS = LogNormal.from_median_mean(150, 300, cap=4_096)
GROWTH_WEIGHT_SIGMA = 1.0
TOOL_SECONDS = LogNormal(median=4.0, sigma=1.5, cap=900.0)


@dataclass(frozen=True)
class LongTail(SweLite):
    """The workload: programs by (seed, index); satisfies closed_loop's Workload."""

    shared_prefix_tokens: int = SYSTEM_PROMPT_TOKENS
    tool_seconds: LogNormal = TOOL_SECONDS
    name: ClassVar[str] = "long-tail"
    key: ClassVar[str] = "long-tail"

    @staticmethod
    def draw(rng: random.Random, program_id: str, tool_seconds: LogNormal) -> TraceProgram:
        return draw_program(rng, program_id, tool_seconds)


def draw_program(rng: random.Random, program_id: str, tool_seconds: LogNormal) -> TraceProgram:
    """One unscaled program: each prompt is the previous one plus its answer and new input, the
    new inputs adding up to the program's drawn final context."""
    n_steps = rng.randint(*STEPS)
    first = SYSTEM_PROMPT_TOKENS + round(TASK_TOKENS.draw(rng))
    completions = [max(1, round(COMPLETION_TOKENS.draw(rng))) for _ in range(n_steps)]
    growth = max(FINAL_CONTEXT_TOKENS.draw(rng) - first - sum(completions[:-1]), float(n_steps))
    weights = [rng.lognormvariate(0.0, GROWTH_WEIGHT_SIGMA) for _ in range(n_steps - 1)]
    total = sum(weights)
    prompt, steps = first, []
    for k in range(n_steps):
        last = k == n_steps - 1
        tool_s = 0.0 if last else tool_seconds.draw(rng)
        steps.append(TraceStep(prompt_tokens=prompt, completion_tokens=completions[k], tool_s=tool_s))
        if not last:
            prompt += completions[k] + max(1, round(growth * weights[k] / total))
    return TraceProgram(id=program_id, steps=tuple(steps), source="long-tail")
