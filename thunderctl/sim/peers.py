"""Published peers as arms: llm-d's prefix-aware router, Dynamo's ThunderAgent router, and the
engine modes of Continuum (TTL pinning, program-level FCFS) and Autellix (PLAS, preemption,
program-aware balancing). Sources, and what is modelled and what approximated:
docs/sim-arms.md, "The peers".
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderctl.scheduler import SchedulerConfig
from thunderctl.scheduler.config import Admission, Waits
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import Preset
from thunderctl.sim.engine import Engine, Request
from thunderctl.sim.routing import EngineRouter, Go, PolicyRouter
from thunderctl.sim.worker import SimWorker

# llm-d's default scorer weights (the Gateway API Inference Extension's default profile).
PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT = 3.0, 2.0, 2.0

# Dynamo's thunderagent_router (ThunderAgentConfig): the soft-demotion band and jumps.
DYNAMO_SOFT_DEMOTE = 0.80
DYNAMO_DEMOTE_JUMP_S = 2.0  # later in the queue, as if it arrived 2 s later
DYNAMO_RESUME_BOOST_S = 1.0
DYNAMO_PAUSE_THRESHOLD = 0.95
DYNAMO_PAUSE_TARGET = 0.80
DYNAMO_RESUME_HYSTERESIS = 0.10
DYNAMO_FORCED_RESUME_S = 1800.0
DYNAMO_BUFFER_TOKENS = 100

# Continuum: tool times remembered per program and engine-wide (the cold start's history).
CONTINUUM_PROGRAM_SAMPLES = 64
CONTINUUM_GLOBAL_SAMPLES = 256

# Autellix's balancer: calls shorter than this go to the least-loaded engine, longer ones stay
# where their program's KV is.
AUTELLIX_SHORT_CALL_TOKENS = 2048


class PrefixAwareRouter(EngineRouter):
    """llm-d's router: each request to the worker of highest weighted score, from a prefix-cache
    scorer (the share of the prompt its index says the worker holds) and load scorers (waiting
    queue, KV use); no program state beyond that index. Ties go to a seeded random pick."""

    def __init__(self, workers: Sequence[SimWorker], seed: int = 0) -> None:
        super().__init__(workers)
        # The approximate prefix index: per worker, the prompt tokens each program sent there, LRU
        # within the worker's KV capacity (it never hears of evictions).
        self.index: dict[str, OrderedDict[str, int]] = {w.id: OrderedDict() for w in self.workers}
        self.indexed = {w.id: 0 for w in self.workers}
        self.random = random.Random(seed)

    def send(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go, group: str | None = None) -> None:
        queues = [len(w.engine.waiting) for w in self.workers]
        low, high = min(queues), max(queues)
        scored = []
        for worker, queue in zip(self.workers, queues, strict=True):
            index = self.index[worker.id]
            matched = index.get(program_id, min(shared_tokens, prompt_tokens) if index else 0)
            queue_score = 1.0 if high == low else (high - queue) / (high - low)
            score = (
                PREFIX_WEIGHT * min(matched, prompt_tokens) / max(prompt_tokens, 1)
                + QUEUE_WEIGHT * queue_score
                + KV_WEIGHT * (1.0 - min(worker.engine.kv_usage, 1.0))
            )
            scored.append((score, worker))
        best = max(score for score, _ in scored)
        chosen = self.random.choice([worker for score, worker in scored if score == best])
        self._remember(chosen, program_id, prompt_tokens)
        self.dispatch(chosen, go)

    def _remember(self, worker: SimWorker, program_id: str, tokens: int) -> None:
        index = self.index[worker.id]
        self.indexed[worker.id] += tokens - index.pop(program_id, 0)
        index[program_id] = tokens
        while self.indexed[worker.id] > worker.engine.shape.kv_capacity_tokens and len(index) > 1:
            _, dropped = index.popitem(last=False)
            self.indexed[worker.id] -= dropped


def dynamo_config() -> SchedulerConfig:
    """Dynamo's ThunderAgentConfig in the project's scheduler: the reference's pause and resume
    (smallest ACTING first, best fit on resume, no admission law, no priced retention) with its
    own band: pause above 0.95 down to 0.80, resume below 0.95 − 0.10, forced resume at 1,800 s."""
    return SchedulerConfig.reference(
        admission=Admission(
            pause_threshold=DYNAMO_PAUSE_THRESHOLD, pause_target=DYNAMO_PAUSE_TARGET,
            resume_threshold=DYNAMO_PAUSE_THRESHOLD - DYNAMO_RESUME_HYSTERESIS, buffer_tokens=DYNAMO_BUFFER_TOKENS,
        ),
        waits=Waits(forced_resume_s=DYNAMO_FORCED_RESUME_S),
    )  # fmt: skip


@dataclass
class DynamoQueue:
    """The router's priority queue, seen in the engine's waiting queue: a request's place is when
    it reaches the queue (after any pause), 2 s later while its program is soft-demoted, 1 s
    earlier just after a resume."""

    clock: VirtualClock
    demoted_until: dict[str, float] = field(default_factory=dict)
    boosted: set[str] = field(default_factory=set)
    ordered: bool = True
    preempt_by_priority: bool = False  # the engine behind it is vLLM's FCFS
    admission_preempts: bool = False

    def on_submit(self, request: Request) -> None:
        program = request.program or ""
        jump = -DYNAMO_RESUME_BOOST_S if program in self.boosted else 0.0
        self.boosted.discard(program)
        now = self.clock.now
        if self.demoted_until.get(program, 0.0) > now:
            jump += DYNAMO_DEMOTE_JUMP_S
        request.priority = now + jump

    def finished(self, request: Request, now: float, engine: Engine) -> float:
        return 0.0


class DynamoRouter(PolicyRouter):
    """The reference policy with Dynamo's band, plus soft demotion: each tick, programs on a
    worker whose charged KV is within [0.80, 0.95) of its capacity queue 2 s later for 1.5 ticks."""

    def __init__(self, workers: Sequence[SimWorker], clock: VirtualClock, queue: DynamoQueue) -> None:
        super().__init__(workers, clock, dynamo_config())
        self.queue = queue

    def _tick(self) -> None:
        now = self.clock.now
        until = now + 1.5 * self.scheduler.config.tick_interval_s
        for worker in self.workers:
            used = self.scheduler.reserved_tokens(worker.id) / worker.engine.shape.kv_capacity_tokens
            if DYNAMO_SOFT_DEMOTE <= used < DYNAMO_PAUSE_THRESHOLD:
                for program_id in self.scheduler.workers[worker.id].programs:
                    self.queue.demoted_until[program_id] = until
        super()._tick()

    def _wake(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go) -> None:
        self.queue.boosted.add(program_id)
        super()._wake(program_id, prompt_tokens, shared_tokens, go)

    def release(self, program_id: str) -> None:
        super().release(program_id)
        self.queue.demoted_until.pop(program_id, None)
        self.queue.boosted.discard(program_id)


@dataclass
class ContinuumTTL:
    """Continuum in the engine: a finished request whose answer is a tool call keeps its KV
    pinned for the TTL τ that maximises F(τ)·B − c·E[min(T, τ)] over its tool times T (the
    program's own, the engine's while it has none): B the re-prefill it saves (seconds, from
    the cost model), c the share of the cache it holds. No pin when no τ gains. The waiting
    queue is program-level FCFS (a program's first arrival), and so is the victim order."""

    preset: Preset
    ordered: bool = True
    preempt_by_priority: bool = True
    admission_preempts: bool = False
    first_seen: dict[str, float] = field(default_factory=dict)
    last_end: dict[str, float] = field(default_factory=dict)
    tool_times: dict[str, deque[float]] = field(default_factory=dict)
    all_tool_times: deque[float] = field(default_factory=lambda: deque(maxlen=CONTINUUM_GLOBAL_SAMPLES))

    def on_submit(self, request: Request) -> None:
        program = request.program or ""
        ended = self.last_end.pop(program, None)
        if ended is not None:
            tool_s = max(0.0, request.arrival_s - ended)
            self.tool_times.setdefault(program, deque(maxlen=CONTINUUM_PROGRAM_SAMPLES)).append(tool_s)
            self.all_tool_times.append(tool_s)
        request.priority = self.first_seen.setdefault(program, request.arrival_s)

    def finished(self, request: Request, now: float, engine: Engine) -> float:
        program = request.program or ""
        if not request.tool_call:  # the program's last answer
            self.first_seen.pop(program, None)
            self.tool_times.pop(program, None)
            return 0.0
        self.last_end[program] = now
        context = request.num_tokens
        benefit_s = context / self.preset.prefill_tokens_per_s(context)
        share = context / engine.shape.kv_capacity_tokens
        return best_ttl(self.tool_times.get(program) or self.all_tool_times, benefit_s, share)


def best_ttl(tool_times: Sequence[float], benefit_s: float, share: float) -> float:
    """The TTL of largest expected gain F(τ)·benefit − share·E[min(T, τ)] over the empirical
    distribution of `tool_times` (its maximum is at a sample); 0 when none gains."""
    samples = sorted(tool_times)
    n = len(samples)
    best, best_gain, below = 0.0, 0.0, 0.0
    for k, tau in enumerate(samples, start=1):
        below += tau
        held_s = (below + (n - k) * tau) / n
        gain = k / n * benefit_s - share * held_s
        if gain > best_gain:
            best, best_gain = tau, gain
    return best


@dataclass
class AutellixPLAS:
    """Autellix's program-level least attained service in the engine: a request's priority is
    the engine time its program's earlier requests took (shared by every engine, like its
    process table); the least-served program runs first and preempts more-served ones."""

    ordered: bool = True
    preempt_by_priority: bool = True
    admission_preempts: bool = True
    attained: dict[str, float] = field(default_factory=dict)

    def on_submit(self, request: Request) -> None:
        request.priority = self.attained.get(request.program or "", 0.0)

    def finished(self, request: Request, now: float, engine: Engine) -> float:
        program = request.program or ""
        if not request.tool_call:
            self.attained.pop(program, None)
        elif request.scheduled_s is not None:
            self.attained[program] = self.attained.get(program, 0.0) + now - request.scheduled_s
        return 0.0


class AutellixRouter(EngineRouter):
    """Autellix's program-aware balancer: a short call to the engine with the fewest requests in
    flight, a long one to the engine its program last ran on (its KV is there)."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        super().__init__(workers)
        self.last: dict[str, SimWorker] = {}

    def send(self, program_id: str, prompt_tokens: int, shared_tokens: int, go: Go, group: str | None = None) -> None:
        worker = self.last.get(program_id)
        if worker is None or prompt_tokens < AUTELLIX_SHORT_CALL_TOKENS:
            worker = self.least_loaded()
        self.last[program_id] = worker
        self.dispatch(worker, go)

    def release(self, program_id: str) -> None:
        self.last.pop(program_id, None)
