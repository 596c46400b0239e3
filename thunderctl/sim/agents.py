"""Agent programs in virtual time: a closed loop of `concurrency` slots, as `thunderctl bench` runs them.

A program sends step k's prompt, gets its answer (exactly `completion_tokens`, like ignore_eos),
waits out the step's tool time and sends step k+1; when it ends its slot starts the next program,
and it is released if its client releases (`Client`). Programs come from the same workloads as the benchmark (anything with
`program(seed, index)`), so every arm of a simulation, and a real run, sees the same programs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.requests import BlockHashes, Request, RetokenizedAnswer, TokenStream
from thunderctl.sim.worker import SimWorker


class Client(StrEnum):
    """How an agent's client talks to the gateway."""

    NAMED = "named"  # names its program in every request and releases it at the end
    UNRELEASED = "unreleased"  # names it, never releases it
    UNCHANGED = "unchanged"  # as shipped: names nothing (the gateway derives the program), never releases

    @property
    def names(self) -> bool:
        return self is not Client.UNCHANGED

    @property
    def releases(self) -> bool:
        return self is Client.NAMED


def program_id(client: Client, seed: int, index: int) -> str:
    """The id a program is scheduled under: its own, or, for a client that names nothing, the one
    the gateway derives from its conversation (each conversation continues only itself, so
    derivation is exact here: one id per program, in the gateway's namespace)."""
    return f"sim-{seed}-{index}" if client.names else f"derived-{seed}-{index}"


def group_id(client: Client, seed: int, group: int) -> str:
    """A rollout task's group: named by the client, or, for one that names nothing, the group the
    gateway derives from the first prompt its samples share (docs/gateway.md)."""
    return f"task-{seed}-{group}" if client.names else f"first-{seed}-{group}"


class Step(Protocol):
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def tool_s(self) -> float: ...


class AgentProgram(Protocol):
    @property
    def steps(self) -> Sequence[Step]: ...
    @property
    def env_prep_s(self) -> float | None: ...


class Workload(Protocol):
    """What the simulator needs of a benchmark workload (bench's swe-lite, traces, shapes)."""

    @property
    def system_prompt_tokens(self) -> int: ...
    @property
    def max_context_tokens(self) -> int | None: ...
    def program(self, seed: int, index: int) -> AgentProgram: ...


class Router(Protocol):
    """How a request finds its worker: one per arm."""

    def send(
        self,
        program_id: str,
        prompt_tokens: int,
        shared_tokens: int,
        go: Callable[[SimWorker], None],
        group: str | None = None,
    ) -> None:
        """Place a request of the program (of `group`, a rollout's task); `go(worker)` submits it
        there, now or once it is admitted."""
        ...

    def done(
        self, program_id: str, worker: SimWorker, prompt_tokens: int, completion_tokens: int, tool: str | None = None
    ) -> None:
        """A request ended; `tool`: what its answer calls, as the gateway reads it (None: nothing it can tell)."""
        ...

    def release(self, program_id: str) -> None: ...


# The tool an answer calls, with `tool_calls`: one kind for all, as the traces record no tools.
TOOL = "bash"


@dataclass(frozen=True)
class SimStep:
    program_index: int
    step: int
    start_s: float  # the agent sent the request
    end_s: float
    worker: str
    admitted_s: float  # the request reached its worker (later than start_s when it waited for admission)
    prompt_tokens: int

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def admission_wait_s(self) -> float:
        return self.admitted_s - self.start_s


def aged_start_fraction(seed: int, index: int) -> float:
    """The share of its life an initial program of an aged run has behind it (bench and sim draw alike)."""
    return random.Random(f"{seed}/age/{index}").random()


def first_step_at(start_fraction: float, n_steps: int) -> int:
    """The step a program of `n_steps` starts at when `start_fraction` of it is history."""
    return min(int(start_fraction * n_steps), n_steps - 1)


def steps_that_fit(
    steps: Sequence[Step], max_context_tokens: int | None, first_step: int = 0, answer_ratio: float | None = None
) -> Sequence[Step]:
    """The steps before the first whose prompt and answer exceed the context (at least one). With
    `answer_ratio`, each prompt from `first_step` on also carries the answers sent before it
    re-tokenized, at that many tokens a generated one."""
    if max_context_tokens is None:
        return steps
    grown = 0
    for k, step in enumerate(steps):
        if k > 0 and step.prompt_tokens + grown + step.completion_tokens > max_context_tokens:
            return steps[:k]
        if answer_ratio is not None and k >= first_step:
            grown += round((answer_ratio - 1.0) * max(1, step.completion_tokens))
    return steps


@dataclass(frozen=True)
class ProgramRun:
    """A program that ran to its end: from its first request sent to its last answer."""

    program_index: int
    sent_s: float
    done_s: float
    steps: int

    @property
    def completion_s(self) -> float:
        return self.done_s - self.sent_s


@dataclass
class _AgentRun:
    index: int
    program_id: str
    group: str | None
    stream: TokenStream
    steps: Sequence[Step]
    next_step: int = 0
    sent_s: float | None = None  # its first request; None for an aged program, whose start is history
    retokenized: int = 0  # tokens its answers so far gained re-tokenized in its prompts


@dataclass
class VirtualAgents:
    workload: Workload
    seed: int
    concurrency: int
    clock: VirtualClock
    router: Router
    block_size: int
    # The first `concurrency` programs start part-way through their life, with a history no
    # cache has seen, as the real load generator's do, so a short run starts near steady state.
    age_initial_programs: bool = False
    client: Client = Client.NAMED
    # Answers call their tools as an OpenAI tool-calling loop's do: the gateway reads each one's
    # tool, and a program's last answer calls none. Off, every answer looks alike to it.
    tool_calls: bool = False
    # A rollout batch (sim/rollout.py): programs in groups of `samples` (index // samples), which
    # share their first prompt; and no program starts after the first `concurrency`.
    samples: int = 0
    # The preset's: how many tokens a generated one becomes sent back in the next prompt, when
    # answers do not round-trip (None: they do).
    answer_retokenized_ratio: float | None = None
    records: list[SimStep] = field(default_factory=list)
    completed: list[ProgramRun] = field(default_factory=list)  # programs that started at step 0, in end order
    sent: dict[int, float] = field(default_factory=dict)  # every such program's first request, ended or not
    programs_started: int = 0
    programs_completed: int = 0
    steps_cut: int = 0
    _next_index: int = 0

    def start(self) -> None:
        for _ in range(self.concurrency):
            self._start_program()

    def _start_program(self) -> None:
        index = self._next_index
        self._next_index += 1
        program = self.workload.program(self.seed, index)
        steps = steps_that_fit(program.steps, self.workload.max_context_tokens)
        shared_blocks = self.workload.system_prompt_tokens // self.block_size
        aged = self.age_initial_programs and index < self.concurrency
        first_step = first_step_at(aged_start_fraction(self.seed, index), len(steps)) if aged else 0
        # Answers re-tokenized in the prompts after them may cut the program sooner.
        steps = steps_that_fit(steps, self.workload.max_context_tokens, first_step, self.answer_retokenized_ratio)
        self.steps_cut += len(program.steps) - len(steps)
        group, stream = None, TokenStream(index + 1, shared_blocks)
        if self.samples:
            task = index // self.samples
            group = group_id(self.client, self.seed, task)
            stream = TokenStream(index + 1, shared_blocks, task + 1, steps[0].prompt_tokens // self.block_size)
        run = _AgentRun(index, program_id(self.client, self.seed, index), group, stream, steps, first_step)
        self.programs_started += 1
        # A program that starts part-way has its environment already.
        prepare_s = (program.env_prep_s or 0.0) if first_step == 0 else 0.0
        self.clock.after(prepare_s, lambda: self._send(run))

    def _send(self, run: _AgentRun) -> None:
        step = run.steps[run.next_step]
        start = self.clock.now
        if run.next_step == 0:
            run.sent_s = self.sent[run.index] = start
        prompt = step.prompt_tokens + run.retokenized
        stream: BlockHashes = run.stream
        if self.answer_retokenized_ratio is not None:
            stream = RetokenizedAnswer(run.stream, prompt // self.block_size, run.next_step)

        def submit(worker: SimWorker) -> None:
            admitted = self.clock.now
            request = Request(
                stream, prompt, max(1, step.completion_tokens), arrival_s=start,
                on_finish=lambda finished: self._done(run, worker, finished, admitted),
                program=run.program_id, tool_call=run.next_step + 1 < len(run.steps),
            )  # fmt: skip
            worker.submit(request)

        self.router.send(run.program_id, prompt, self.workload.system_prompt_tokens, submit, run.group)

    def _done(self, run: _AgentRun, worker: SimWorker, request: Request, admitted_s: float) -> None:
        step = run.steps[run.next_step]
        self.records.append(
            SimStep(
                run.index,
                run.next_step,
                request.arrival_s,
                self.clock.now,
                worker.id,
                admitted_s,
                request.prompt_tokens,
            )
        )
        tool = TOOL if self.tool_calls and request.tool_call else None
        self.router.done(run.program_id, worker, request.prompt_tokens, request.max_tokens, tool)
        if self.answer_retokenized_ratio is not None:
            run.retokenized += round((self.answer_retokenized_ratio - 1.0) * request.max_tokens)
        run.next_step += 1
        if run.next_step < len(run.steps):
            self.clock.after(step.tool_s, lambda: self._send(run))
            return
        self.programs_completed += 1
        if run.sent_s is not None:
            self.completed.append(ProgramRun(run.index, run.sent_s, self.clock.now, len(run.steps)))
        if self.client.releases:
            self.router.release(run.program_id)
        if not self.samples:  # a closed loop: its slot starts the next program
            self._start_program()
