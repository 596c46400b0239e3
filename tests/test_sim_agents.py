"""Simulated agents start where the real load generator's do, so a short simulation and a short
real run of the same seed begin from the same state."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from thunderctl.bench.planning import plan_program
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.sim.agents import TOOL, VirtualAgents, aged_start_fraction
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import EngineShape, LinearStepCost
from thunderctl.sim.engine import Engine
from thunderctl.sim.routing import StickyRouter
from thunderctl.sim.worker import SimWorker
from thunderctl.traceformat import TraceProgram

PREPARATION_S = 30.0


@dataclass(frozen=True)
class PreparedShape:
    """Programs of a shape whose environment takes `PREPARATION_S` to prepare."""

    shape: AgentShape

    @property
    def system_prompt_tokens(self) -> int:
        return self.shape.system_prompt_tokens

    @property
    def max_context_tokens(self) -> int | None:
        return self.shape.max_context_tokens

    def program(self, seed: int, index: int) -> TraceProgram:
        return self.shape.program(seed, index).model_copy(update={"env_prep_s": PREPARATION_S})


WORKLOAD = PreparedShape(
    AgentShape(
        system_prompt_tokens=64,
        task_tokens=Uniform(100, 200),
        observation_tokens=Uniform(20, 60),
        completion_tokens=Uniform(5, 10),
        steps=Uniform(8, 16),
        tool_seconds=Uniform(0.5, 1.0),
    )
)
COST = LinearStepCost(base_s=0.01, per_token_s=1e-5, per_attention_pair_s=0.0, per_seq_s=0.0, per_context_token_s=0.0)
SHAPE = EngineShape(
    num_gpu_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192
)
CONCURRENCY = 6


def first_records(*, aged: bool, seed: int = 3) -> dict[int, tuple[int, float]]:
    """Each program's first simulated step: (its index in the program, when it was sent)."""
    clock = VirtualClock()
    loop = VirtualAgents(
        WORKLOAD, seed, CONCURRENCY, clock, StickyRouter([SimWorker("w0", Engine(SHAPE, COST), clock)]), SHAPE.block_size,
        age_initial_programs=aged,
    )  # fmt: skip
    loop.start()
    clock.run_until(120.0)
    first: dict[int, tuple[int, float]] = {}
    for record in loop.records:
        first.setdefault(record.program_index, (record.step, record.start_s))
    return first


def test_aged_initial_programs_start_at_the_step_the_real_load_generator_starts_them() -> None:
    seed = 3
    first = first_records(aged=True, seed=seed)
    for index in range(CONCURRENCY):
        plan = plan_program(
            WORKLOAD, seed=seed, salt="s", index=index, tokens_per_word=1.0, system_text="x",
            start_fraction=aged_start_fraction(seed, index),
        )  # fmt: skip
        assert first[index][0] == plan.first_step
    assert any(step > 0 for step, _ in first.values()), "some programs start part-way"


def test_aged_programs_that_start_part_way_skip_their_environment_preparation() -> None:
    first = first_records(aged=True)
    for index in range(CONCURRENCY):
        step, sent_s = first[index]
        assert sent_s == (0.0 if step > 0 else pytest.approx(PREPARATION_S))


def test_without_ageing_every_program_starts_at_its_first_step() -> None:
    first = first_records(aged=False)
    assert {step for step, _ in first.values()} == {0}
    assert all(first[index][1] == pytest.approx(PREPARATION_S) for index in range(CONCURRENCY))


class ToolsSeen(StickyRouter):
    """A sticky router that keeps the tool the gateway would read from each answer, by program."""

    def __init__(self, workers: list[SimWorker]) -> None:
        super().__init__(workers)
        self.tools: dict[str, list[str | None]] = {}

    def done(
        self, program_id: str, worker: SimWorker, prompt_tokens: int, completion_tokens: int, tool: str | None = None
    ) -> None:
        super().done(program_id, worker, prompt_tokens, completion_tokens, tool)
        self.tools.setdefault(program_id, []).append(tool)


@pytest.mark.parametrize("tool_calls", [False, True])
def test_tool_calling_agents_show_a_tool_in_every_answer_but_their_last(tool_calls) -> None:
    clock = VirtualClock()
    router = ToolsSeen([SimWorker("w0", Engine(SHAPE, COST), clock)])
    loop = VirtualAgents(WORKLOAD, 3, CONCURRENCY, clock, router, SHAPE.block_size, tool_calls=tool_calls)
    loop.start()
    clock.run_until(600.0)
    assert loop.completed, "some programs ended"
    for run in loop.completed:
        tools = router.tools[f"sim-3-{run.program_index}"]
        assert len(tools) == run.steps
        assert tools == ([TOOL] * (run.steps - 1) + [None] if tool_calls else [None] * run.steps)


def test_answers_sent_back_re_tokenized_grow_each_next_prompt_by_the_ratio() -> None:
    clock = VirtualClock()
    router = StickyRouter([SimWorker("w0", Engine(SHAPE, COST), clock)])
    loop = VirtualAgents(WORKLOAD, 3, CONCURRENCY, clock, router, SHAPE.block_size, answer_retokenized_ratio=1.5)
    loop.start()
    clock.run_until(600.0)
    program = WORKLOAD.program(3, 0)
    sent = sorted((r.step, r.prompt_tokens) for r in loop.records if r.program_index == 0)
    assert len(sent) > 2, "the program ran some steps"
    grown = 0
    for step, prompt_tokens in sent:
        assert prompt_tokens == program.steps[step].prompt_tokens + grown
        grown += round(0.5 * max(1, program.steps[step].completion_tokens))
