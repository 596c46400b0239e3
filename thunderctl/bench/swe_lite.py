"""`swe-lite --synthetic`: a seeded workload shaped like mini-swe-agent's runs (docs/bench.md).

Targets (published statistics of 500 mini-swe-agent v1.15 runs on SWE-bench Verified, Gemini 3 Pro):
steps per program p50 36 / p90 66 / max 145; first prompt ~1.65k tokens; prompt growth per
step p50 315 / mean 583; completion p50 89 / mean 276 tokens. Every quantity is a lognormal
drawn from a generator seeded by (seed, program index), so a program is the same in every run
and in every arm of a comparison. `scale` multiplies every token count and keeps the shape.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, ClassVar

from thunderctl.traceformat import TraceProgram, TraceStep

Z90 = NormalDist().inv_cdf(0.9)


@dataclass(frozen=True)
class LogNormal:
    """A lognormal given by its median and log-space sigma, optionally capped."""

    median: float
    sigma: float
    cap: float | None = None

    def draw(self, rng: random.Random) -> float:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return value if self.cap is None else min(value, self.cap)

    def mean(self) -> float:
        """The mean after the cap (closed form)."""
        mu = math.log(self.median)
        full = math.exp(mu + self.sigma**2 / 2)
        if self.cap is None:
            return full
        a = (math.log(self.cap) - mu) / self.sigma
        below = NormalDist().cdf(a - self.sigma)
        return full * below + self.cap * (1 - NormalDist().cdf(a))

    @classmethod
    def from_median_p90(cls, median: float, p90: float, cap: float | None = None) -> LogNormal:
        return cls(median, math.log(p90 / median) / Z90, cap)

    @classmethod
    def from_median_mean(cls, median: float, mean: float, cap: float | None = None) -> LogNormal:
        """The sigma whose (capped) mean is `mean`, by bisection: the capped mean grows with
        sigma over any range where it is below cap / 2."""
        low, high = 1e-6, 4.0
        for _ in range(60):
            middle = (low + high) / 2
            if cls(median, middle, cap).mean() < mean:
                low = middle
            else:
                high = middle
        return cls(median, (low + high) / 2, cap)


# mini-swe-agent's system message: the only part of the first prompt every program shares
# (its instance template puts the task near the top, so the rest is not a common prefix).
SHARED_PREFIX_TOKENS = 160
# The instance template around the task; with the task below it gives a first prompt of
# median ~1.65k, p10 ~1.43k, p90 ~2.35k tokens, as in the runs (1.39k / 1.65k / 2.37k).
TEMPLATE_TOKENS = 1330
TASK_TOKENS = LogNormal(median=320, sigma=0.9, cap=8192)
STEPS = LogNormal.from_median_p90(36, 66, cap=145)
COMPLETION_TOKENS = LogNormal.from_median_mean(89, 276, cap=8192)
# What a step adds besides the previous answer (observation and template). The mean is
# 583 - 276 so that growth has mean 583; the median was fitted by simulation (4M draws) so
# that completion + new input has median 315, as the growth of the runs does.
NEW_INPUT_TOKENS = LogNormal.from_median_mean(133, 583 - 276, cap=8192)
TOOL_SECONDS = LogNormal(median=2.0, sigma=1.0, cap=60.0)
# Long runs grow more slowly per step (log-correlation -0.2 in the runs). New input scales with
# (steps / 36) ** -0.3, which brings the final prompt's p90 from ~41k down to the runs' ~38k.
STEPS_GROWTH_EXPONENT = 0.3


@dataclass(frozen=True)
class ScaledWorkload:
    """What every replayed workload shares: token counts times `scale`, a shared prefix,
    and the context limit of the engine it runs on."""

    scale: float = 1.0
    shared_prefix_tokens: int = SHARED_PREFIX_TOKENS
    # Set from the engine's max_model_len: a program ends before a prompt it would reject.
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError(f"scale must be positive, got {self.scale}")

    @property
    def system_prompt_tokens(self) -> int:
        return max(1, round(self.shared_prefix_tokens * self.scale))


@dataclass(frozen=True)
class SweLite(ScaledWorkload):
    """The workload: programs by (seed, index); satisfies closed_loop's Workload. A generator of
    another shape subclasses it with its own `draw`, `name` and seed `key`."""

    tool_seconds: LogNormal = TOOL_SECONDS
    name: ClassVar[str] = "swe-lite-synthetic"
    key: ClassVar[str] = "swe-lite"

    def program(self, seed: int, index: int) -> TraceProgram:
        rng = random.Random(f"{self.key}/{seed}/{index}")
        return self.draw(rng, f"{self.key}-{seed}-{index}", self.tool_seconds).scaled(self.scale)

    @staticmethod
    def draw(rng: random.Random, program_id: str, tool_seconds: LogNormal) -> TraceProgram:
        return draw_program(rng, program_id, tool_seconds)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}


def new_input_factor(n_steps: int) -> float:
    """(n / median) ** -b, normalised so that the mean growth over all steps stays the target:
    with n lognormal, E[n ** a] = exp(a mu + a^2 sigma^2 / 2)."""
    b, mu, sigma = STEPS_GROWTH_EXPONENT, math.log(STEPS.median), STEPS.sigma

    def moment(a: float) -> float:
        return math.exp(a * mu + a * a * sigma * sigma / 2)

    norm = moment(1) / (STEPS.median**b * moment(1 - b))
    return norm * (n_steps / STEPS.median) ** -b


def draw_program(rng: random.Random, program_id: str, tool_seconds: LogNormal) -> TraceProgram:
    """One unscaled program: each prompt is the previous one plus its answer and new input."""
    n_steps = max(1, round(STEPS.draw(rng)))
    factor = new_input_factor(n_steps)
    prompt = TEMPLATE_TOKENS + round(TASK_TOKENS.draw(rng))
    steps = []
    for k in range(n_steps):
        completion = max(1, round(COMPLETION_TOKENS.draw(rng)))
        tool_s = tool_seconds.draw(rng) if k < n_steps - 1 else 0.0
        steps.append(TraceStep(prompt_tokens=prompt, completion_tokens=completion, tool_s=tool_s))
        prompt += completion + max(1, round(NEW_INPUT_TOKENS.draw(rng) * factor))
    return TraceProgram(id=program_id, steps=tuple(steps), source="swe-lite")
