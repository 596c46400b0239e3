"""Programs planned as text: a workload's token sizes rendered as messages of words (pure).

Text is made of words from a fixed list that the engine's tokenizer maps to about one token
each; the driver measures the ratio with the engine's `/tokenize` so that "500 observation
tokens" means roughly 500 tokens on whatever model is being served.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from thunderctl.bench.shapes import MESSAGE_OVERHEAD_TOKENS, Workload
from thunderctl.sim.agents import first_step_at
from thunderctl.traceformat import TraceProgram

# Ordinary English words; each is a single token (with its leading space) in the tiny test
# model's tokenizer and in the common BPE vocabularies, so token counts are predictable.
WORDS: tuple[str, ...] = (
    "above", "access", "after", "also", "apply", "based", "below", "both",
    "call", "case", "change", "code", "copy", "could", "data", "date",
    "detail", "document", "each", "edit", "file", "files", "first", "follow",
    "form", "format", "from", "full", "function", "give", "input", "install",
    "item", "library", "line", "link", "list", "machine", "make", "name",
    "network", "new", "number", "object", "option", "order", "output", "page",
    "part", "pass", "place", "program", "public", "run", "same", "server",
    "source", "state", "system", "text", "time", "title", "under", "user",
    "version", "which", "with", "word", "work", "year",
)  # fmt: skip


def words_for_tokens(tokens: float, tokens_per_word: float) -> int:
    return max(1, round(tokens / tokens_per_word))


def word_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def system_prompt(workload: Workload, seed: int, salt: str, tokens_per_word: float) -> str:
    """The prompt every program of a run shares; the salt comes first so that no cached
    block of another run (another arm of a comparison) can match it."""
    rng = random.Random(f"{seed}/system")
    head = f"run {salt}. You are a software agent."
    return f"{head} {word_text(rng, words_for_tokens(workload.system_prompt_tokens, tokens_per_word))}"


@dataclass(frozen=True)
class StepPlan:
    completion_tokens: int
    tool_seconds: float
    # Appended as the next user message after this step's answer ("" after the last step).
    observation: str
    observation_tokens: int = 0


@dataclass(frozen=True)
class ProgramPlan:
    index: int
    program_id: str
    messages: tuple[dict[str, str], ...]
    first_step: int
    steps: tuple[StepPlan, ...]
    prepare_s: float = 0.0
    # Steps of the workload's program left out because the context would not fit.
    steps_cut: int = 0
    # The GRPO group it is a sample of (`plan_program`'s task), None outside a rollout.
    group_id: str | None = None


@dataclass(frozen=True)
class StepSizes:
    """A step as tokens: what it asks for, and what the observation after it adds."""

    completion_tokens: int
    observation_tokens: int
    tool_seconds: float


def step_sizes(program: TraceProgram, system_prompt_tokens: int) -> tuple[int, list[StepSizes]]:
    """The task's size and each step's sizes, so that each rendered prompt is the program's.

    A prompt is the previous one plus the answer, the observation and two messages' template
    tokens. Where the program's prompt grew by less than that (a short observation at a small
    scale, or an agent that shortened its history) the observation is one token and the
    rendered prompt runs ahead; later observations shrink until it is back on the program's.
    """
    overhead = 2 * MESSAGE_OVERHEAD_TOKENS
    steps = program.steps
    task_tokens = max(1, steps[0].prompt_tokens - system_prompt_tokens - overhead)
    rendered = system_prompt_tokens + task_tokens + overhead
    sizes = []
    for step, later in zip(steps, [*steps[1:], None]):
        completion = max(1, step.completion_tokens)
        observation = 0 if later is None else max(1, later.prompt_tokens - rendered - completion - overhead)
        sizes.append(StepSizes(completion, observation, step.tool_s))
        rendered += completion + observation + overhead
    return task_tokens, sizes


def plan_program(
    workload: Workload,
    *,
    seed: int,
    salt: str,
    index: int,
    tokens_per_word: float,
    system_text: str,
    start_fraction: float = 0.0,
    task: int | None = None,
) -> ProgramPlan:
    """Everything program `index` will send, as text of the workload's sizes.

    The workload's program depends only on (seed, index), so two runs with the same seed
    offer the same workload whatever the timing. `start_fraction` skips that share of the
    steps, putting synthetic turns of the program's sizes in the history instead. Programs
    given the same `task` are samples of one task (a GRPO group): the same task text, so the
    same first prompt when the workload gives them the same first size.
    """
    program = workload.program(seed, index)
    task_tokens, sized = step_sizes(program, workload.system_prompt_tokens)
    n_steps = steps_that_fit(workload, task_tokens, sized)
    sized = sized[:n_steps]
    first_step = first_step_at(start_fraction, n_steps)

    text_rng = random.Random(f"{seed}/text/{index}")
    task_rng = text_rng if task is None else random.Random(f"{seed}/task/{task}")
    task_text = (
        f"Task {index if task is None else task}: {word_text(task_rng, words_for_tokens(task_tokens, tokens_per_word))}"
    )
    observations = [
        word_text(text_rng, words_for_tokens(step.observation_tokens, tokens_per_word)) if k < n_steps - 1 else ""
        for k, step in enumerate(sized)
    ]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system_text},
        {"role": "user", "content": task_text},
    ]
    for k in range(first_step):
        answer = word_text(text_rng, words_for_tokens(sized[k].completion_tokens, tokens_per_word))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": observations[k]}]
    steps = tuple(
        StepPlan(
            step.completion_tokens,
            step.tool_seconds,
            observations[k],
            step.observation_tokens if observations[k] else 0,
        )
        for k, step in enumerate(sized)
        if k >= first_step
    )
    # A program that starts part-way has its environment already.
    prepare_s = (program.env_prep_s or 0.0) if first_step == 0 else 0.0
    group_id = None if task is None else f"{salt}-t{task}"
    return ProgramPlan(
        index, f"{salt}-p{index}", tuple(messages), first_step, steps, prepare_s, len(program.steps) - n_steps, group_id
    )


def steps_that_fit(workload: Workload, task_tokens: int, sized: Sequence[StepSizes]) -> int:
    """How many steps run before prompt + answer would exceed max_context_tokens (at least 1)."""
    if workload.max_context_tokens is None:
        return len(sized)
    context = workload.system_prompt_tokens + task_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
    for k, step in enumerate(sized):
        if k > 0 and context + step.completion_tokens > workload.max_context_tokens:
            return k
        context += step.completion_tokens + step.observation_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
    return len(sized)
