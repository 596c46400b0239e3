"""Closed-loop agent load: programs whose context grows step by step, like a coding agent.

Each of `concurrency` slots runs one program at a time and starts the next when it ends.
A program sends its whole history every step (a shared system prompt, its task, then the
assistant turns and tool observations so far), waits out a tool call, and repeats. What the
programs look like comes from a workload: `AgentShape` (uniform ranges), the `swe-lite`
generator, or a recorded trace; each gives a program as a trace (prompt and answer sizes per
step, tool times), which is rendered here as text of those sizes. The same
load can go straight to vLLM servers ("direct", each program sticky to one server, or each
request to the next server) or through
the thunderctl gateway ("gateway", with `program_id` on every request and a release at the
end), so the two can be compared on equal terms.

Text is made of words from a fixed list that the engine's tokenizer maps to about one token
each; `calibrate_tokens_per_word` measures the ratio with the engine's `/tokenize` so that
"500 observation tokens" means roughly 500 tokens on whatever model is being served.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from thunderctl.bench.trace import TraceProgram, TraceStep
from thunderctl.engines.vllm import EngineMetrics, fetch_metrics
from thunderctl.jsonapi import bearer_headers
from thunderctl.sim.agents import aged_start_fraction, first_step_at

if TYPE_CHECKING:  # sandboxes.py builds on this module
    from thunderctl.bench.sandboxes import SandboxSample, SandboxTools, ToolRecord

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
# Used when the engine cannot tokenize for us; real tokenizers give ~1.0-1.3 on these words.
DEFAULT_TOKENS_PER_WORD = 1.0
CALIBRATION_WORDS = 400
# Chat-template tokens around each message (role markers, separators), for context estimates.
MESSAGE_OVERHEAD_TOKENS = 8


# --- workload shape ------------------------------------------------------------------


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
            steps.append(TraceStep(prompt_tokens=prompt, completion_tokens=completion, tool_s=self.tool_seconds.draw(rng)))
            prompt += completion + observation + 2 * MESSAGE_OVERHEAD_TOKENS
        return TraceProgram(id=f"shape-{seed}-{index}", steps=tuple(steps))


@dataclass(frozen=True)
class LoadSpec:
    """How much load: `programs` in total and/or for `duration_s`, whichever ends first."""

    concurrency: int
    shape: Workload = AgentShape()
    programs: int | None = None
    duration_s: float | None = None
    seed: int = 0
    model: str = "tiny"
    # Steps that start before this many seconds are left out of the steady-window figures.
    warmup_s: float = 0.0
    stream: bool = False
    # Part of the system prompt, so two runs never share cached prefixes; None draws one.
    salt: str | None = None
    # The first `concurrency` programs start part-way through their life (with synthetic
    # history), so that a short run begins near steady state instead of all at step 0.
    age_initial_programs: bool = False
    request_timeout_s: float = 900.0
    # Tool and environment-preparation times are slept this many times as long.
    time_scale: float = 1.0
    # How often the engines' counters are read during the run (for figures over time).
    sample_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.programs is None and self.duration_s is None:
            raise ValueError("LoadSpec needs programs, duration_s or both")
        if self.time_scale < 0:
            raise ValueError("time_scale must not be negative")


class Routing(StrEnum):
    STICKY = "sticky"  # every step of a program to the same server, as agents do
    ROUND_ROBIN = "round-robin"  # each request to the next server


@dataclass
class Target:
    """Where the load goes: vLLM servers directly, or the gateway."""

    name: str
    urls: list[str]
    program_ids: bool
    routing: Routing = Routing.STICKY
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token with every request
    _turns: itertools.count[int] = field(default_factory=itertools.count, repr=False, compare=False)

    @classmethod
    def direct(
        cls, urls: list[str], routing: Routing = Routing.STICKY, name: str = "direct", api_key: str | None = None
    ) -> Target:
        return cls(name, list(urls), program_ids=False, routing=routing, api_key=api_key)

    @classmethod
    def gateway(cls, url: str, name: str = "gateway", api_key: str | None = None) -> Target:
        return cls(name, [url], program_ids=True, api_key=api_key)

    @property
    def headers(self) -> dict[str, str]:
        return bearer_headers(self.api_key)

    def url_for(self, program_index: int) -> str:
        """The server for the next request of program `program_index`."""
        turn = next(self._turns) if self.routing is Routing.ROUND_ROBIN else program_index
        return self.urls[turn % len(self.urls)].rstrip("/")


# --- text and program plans (pure) ---------------------------------------------------


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
) -> ProgramPlan:
    """Everything program `index` will send, as text of the workload's sizes.

    The workload's program depends only on (seed, index), so two runs with the same seed
    offer the same workload whatever the timing. `start_fraction` skips that share of the
    steps, putting synthetic turns of the program's sizes in the history instead.
    """
    program = workload.program(seed, index)
    task_tokens, sized = step_sizes(program, workload.system_prompt_tokens)
    n_steps = steps_that_fit(workload, task_tokens, sized)
    sized = sized[:n_steps]
    first_step = first_step_at(start_fraction, n_steps)

    text_rng = random.Random(f"{seed}/text/{index}")
    task = f"Task {index}: {word_text(text_rng, words_for_tokens(task_tokens, tokens_per_word))}"
    observations = [
        word_text(text_rng, words_for_tokens(step.observation_tokens, tokens_per_word)) if k < n_steps - 1 else ""
        for k, step in enumerate(sized)
    ]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system_text},
        {"role": "user", "content": task},
    ]
    for k in range(first_step):
        answer = word_text(text_rng, words_for_tokens(sized[k].completion_tokens, tokens_per_word))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": observations[k]}]
    steps = tuple(
        StepPlan(step.completion_tokens, step.tool_seconds, observations[k], step.observation_tokens if observations[k] else 0)
        for k, step in enumerate(sized)
        if k >= first_step
    )
    # A program that starts part-way has its environment already.
    prepare_s = (program.env_prep_s or 0.0) if first_step == 0 else 0.0
    return ProgramPlan(
        index, f"{salt}-p{index}", tuple(messages), first_step, steps, prepare_s, len(program.steps) - n_steps
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


# --- records and statistics (pure) ---------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    program_id: str
    program_index: int
    step: int
    start_s: float  # since the start of the run
    latency_s: float
    ok: bool
    status: int  # HTTP status; 0 when no response arrived
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None  # streaming only
    error: str | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolating linearly between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def steady_steps(records: Sequence[StepRecord], warmup_s: float, window_end_s: float) -> list[StepRecord]:
    """Successful steps that started after the warm-up and finished inside the window."""
    return [r for r in records if r.ok and r.start_s >= warmup_s and r.end_s <= window_end_s]


def per_minute(count: int, window_s: float) -> float:
    return 60.0 * count / window_s if window_s > 0 else 0.0


@dataclass(frozen=True)
class CacheDelta:
    """Change of the engines' counters over a run, summed over the engines."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0

    @classmethod
    def between(cls, before: Sequence[EngineMetrics], after: Sequence[EngineMetrics]) -> CacheDelta:
        return cls(
            prefix_cache_queries=sum(a.prefix_cache_queries - b.prefix_cache_queries for b, a in zip(before, after)),
            prefix_cache_hits=sum(a.prefix_cache_hits - b.prefix_cache_hits for b, a in zip(before, after)),
            preemptions=sum(a.preemptions - b.preemptions for b, a in zip(before, after)),
        )

    def __add__(self, other: CacheDelta) -> CacheDelta:
        return CacheDelta(
            self.prefix_cache_queries + other.prefix_cache_queries,
            self.prefix_cache_hits + other.prefix_cache_hits,
            self.preemptions + other.preemptions,
        )

    def __sub__(self, other: CacheDelta) -> CacheDelta:
        return CacheDelta(
            self.prefix_cache_queries - other.prefix_cache_queries,
            self.prefix_cache_hits - other.prefix_cache_hits,
            self.preemptions - other.preemptions,
        )

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True)
class CounterSample:
    """The engines' counters over one sampling interval that ended at `t_s`."""

    t_s: float
    engines: CacheDelta


@dataclass
class LoadResult:
    target: str
    concurrency: int
    salt: str
    tokens_per_word: float
    wall_s: float
    window_s: float  # length of the steady window (after warm-up)
    steps_ok: int
    steps_failed: int
    steps_cancelled: int  # in flight when the run's time was up
    steady_latencies_s: list[float]
    programs_started: int
    programs_completed: int
    engines: CacheDelta
    release_failures: int = 0
    records: list[StepRecord] = field(default_factory=list)
    steady_ttfts_s: list[float] = field(default_factory=list)  # streaming only
    samples: list[CounterSample] = field(default_factory=list)
    steps_cut: int = 0  # steps of started programs left out to fit the context limit
    # With tool steps in sandboxes (`bench swe-lite --sandboxes`):
    tool_records: list[ToolRecord] = field(default_factory=list)
    sandbox_samples: list[SandboxSample] = field(default_factory=list)
    sandbox_create_failures: int = 0

    @property
    def steady_steps(self) -> int:
        return len(self.steady_latencies_s)

    @property
    def steps_per_min(self) -> float:
        return per_minute(self.steady_steps, self.window_s)

    @property
    def p50_s(self) -> float | None:
        return percentile(self.steady_latencies_s, 50)

    @property
    def p90_s(self) -> float | None:
        return percentile(self.steady_latencies_s, 90)

    @property
    def p99_s(self) -> float | None:
        return percentile(self.steady_latencies_s, 99)

    @property
    def ttft_p50_s(self) -> float | None:
        return percentile(self.steady_ttfts_s, 50)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.engines.hit_rate

    @property
    def preemptions(self) -> int:
        return self.engines.preemptions

    def summary(self) -> dict[str, Any]:
        """The headline figures, JSON-ready."""
        return {
            "target": self.target,
            "concurrency": self.concurrency,
            "steps_per_min": self.steps_per_min,
            "steady_steps": self.steady_steps,
            "window_s": self.window_s,
            "wall_s": self.wall_s,
            "steps_ok": self.steps_ok,
            "steps_failed": self.steps_failed,
            "steps_cancelled": self.steps_cancelled,
            "p50_s": self.p50_s,
            "p90_s": self.p90_s,
            "p99_s": self.p99_s,
            "ttft_p50_s": self.ttft_p50_s,
            "programs_started": self.programs_started,
            "programs_completed": self.programs_completed,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "preemptions": self.preemptions,
            "release_failures": self.release_failures,
            "steps_cut": self.steps_cut,
            **{f"engine_{key}": value for key, value in asdict(self.engines).items()},
            "tokens_per_word": self.tokens_per_word,
            "salt": self.salt,
        }


def combine_results(results: Sequence[LoadResult]) -> LoadResult:
    """Pool the slices of one arm: windows and counts add up, latencies are pooled, and
    records and samples follow each other in time as if the slices had run back to back."""
    if not results:
        raise ValueError("nothing to combine")
    first = results[0]
    engines = CacheDelta()
    for result in results:
        engines = engines + result.engines
    offsets = list(itertools.accumulate((r.wall_s for r in results[:-1]), initial=0.0))
    return LoadResult(
        target=first.target,
        concurrency=first.concurrency,
        salt=",".join(r.salt for r in results),
        tokens_per_word=first.tokens_per_word,
        wall_s=sum(r.wall_s for r in results),
        window_s=sum(r.window_s for r in results),
        steps_ok=sum(r.steps_ok for r in results),
        steps_failed=sum(r.steps_failed for r in results),
        steps_cancelled=sum(r.steps_cancelled for r in results),
        steady_latencies_s=[x for r in results for x in r.steady_latencies_s],
        programs_started=sum(r.programs_started for r in results),
        programs_completed=sum(r.programs_completed for r in results),
        engines=engines,
        release_failures=sum(r.release_failures for r in results),
        records=[replace(rec, start_s=rec.start_s + offset) for r, offset in zip(results, offsets) for rec in r.records],
        steady_ttfts_s=[x for r in results for x in r.steady_ttfts_s],
        samples=[replace(s, t_s=s.t_s + offset) for r, offset in zip(results, offsets) for s in r.samples],
        steps_cut=sum(r.steps_cut for r in results),
        tool_records=[replace(t, start_s=t.start_s + offset) for r, offset in zip(results, offsets) for t in r.tool_records],
        sandbox_samples=[replace(s, t_s=s.t_s + offset) for r, offset in zip(results, offsets) for s in r.sandbox_samples],
        sandbox_create_failures=sum(r.sandbox_create_failures for r in results),
    )


# --- HTTP ----------------------------------------------------------------------------


async def calibrate_tokens_per_word(client: httpx.AsyncClient, engine_url: str, model: str) -> float:
    """Tokens per word of WORDS text on this engine, from its `/tokenize` endpoint."""
    text = word_text(random.Random("calibration"), CALIBRATION_WORDS)
    try:
        response = await client.post(
            f"{engine_url.rstrip('/')}/tokenize",
            json={"model": model, "prompt": text, "add_special_tokens": False},
        )
        response.raise_for_status()
        count = int(response.json()["count"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return DEFAULT_TOKENS_PER_WORD
    return count / CALIBRATION_WORDS if count > 0 else DEFAULT_TOKENS_PER_WORD


async def scrape_engines(client: httpx.AsyncClient, engine_urls: Sequence[str]) -> list[EngineMetrics]:
    return list(await asyncio.gather(*(fetch_metrics(client, url) for url in engine_urls)))


@dataclass
class _Reply:
    status: int
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    error: str | None = None


class Observer(Protocol):
    """Told about a run as it goes (a live progress display)."""

    def step(self, record: StepRecord) -> None: ...

    def sample(self, sample: CounterSample) -> None: ...


class ClosedLoop:
    """One run: the slots, the programs they run, and what each step recorded."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        target: Target,
        spec: LoadSpec,
        salt: str,
        tokens_per_word: float,
        observer: Observer | None = None,
        tools: SandboxTools | None = None,
    ):
        self.client = client
        self.tools = tools  # None: tool steps are slept
        self.target = target
        self.spec = spec
        self.salt = salt
        self.tokens_per_word = tokens_per_word
        self.observer = observer
        self.system_text = system_prompt(spec.shape, spec.seed, salt, tokens_per_word)
        self.records: list[StepRecord] = []
        self.programs_started = 0
        self.programs_completed = 0
        self.steps_cancelled = 0
        self.steps_cut = 0
        self.release_failures = 0
        self.open_programs: set[str] = set()
        self._t0 = 0.0
        self._next_index = 0

    def now(self) -> float:
        return time.monotonic() - self._t0

    def start_clock(self) -> None:
        self._t0 = time.monotonic()

    async def execute(self) -> float:
        """Run until the programs are done or the time is up; returns the wall time."""
        slots = [asyncio.create_task(self.slot()) for _ in range(self.spec.concurrency)]
        try:
            done, pending = await asyncio.wait(slots, timeout=self.spec.duration_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()  # a bug in a slot must not pass silently
        finally:
            for task in slots:
                task.cancel()
            # Programs cut off by the deadline still hold reservations in the gateway.
            await asyncio.gather(*(self.release(pid) for pid in list(self.open_programs)))
        return self.now()

    def take_program_index(self) -> int | None:
        spec = self.spec
        if spec.programs is not None and self._next_index >= spec.programs:
            return None
        if spec.duration_s is not None and self.now() >= spec.duration_s:
            return None
        index = self._next_index
        self._next_index += 1
        return index

    def plan(self, index: int) -> ProgramPlan:
        aged = self.spec.age_initial_programs and index < self.spec.concurrency
        fraction = aged_start_fraction(self.spec.seed, index) if aged else 0.0
        return plan_program(
            self.spec.shape,
            seed=self.spec.seed,
            salt=self.salt,
            index=index,
            tokens_per_word=self.tokens_per_word,
            system_text=self.system_text,
            start_fraction=fraction,
        )

    async def slot(self) -> None:
        while (index := self.take_program_index()) is not None:
            await self.run_program(self.plan(index))

    async def run_program(self, plan: ProgramPlan) -> None:
        messages = list(plan.messages)
        self.programs_started += 1
        self.steps_cut += plan.steps_cut
        if self.tools is None:
            await asyncio.sleep(plan.prepare_s * self.spec.time_scale)
            await self.run_steps(plan, messages, None)
            return
        # A real sandbox replaces the slept preparation: asked for now, prepared while the program
        # runs its first step (or waits for it), waited for by the first tool step.
        sandbox_id = await self.tools.open(plan)
        try:
            await self.run_steps(plan, messages, sandbox_id)
        finally:
            await self.tools.finish(sandbox_id, released=self.target.program_ids)

    async def run_steps(self, plan: ProgramPlan, messages: list[dict[str, str]], sandbox_id: str | None) -> None:
        if self.target.program_ids:
            self.open_programs.add(plan.program_id)
        completed = True
        for offset, step in enumerate(plan.steps):
            url = self.target.url_for(plan.index)
            record, text = await self.send_step(url, plan, plan.first_step + offset, messages, step)
            self.records.append(record)
            if self.observer is not None:
                self.observer.step(record)
            if not record.ok:
                completed = False
                break
            messages.append({"role": "assistant", "content": text})
            if offset < len(plan.steps) - 1:
                messages.append({"role": "user", "content": step.observation})
                if self.tools is None:
                    await asyncio.sleep(step.tool_seconds * self.spec.time_scale)
                else:
                    await self.tools.run_step(sandbox_id, plan, plan.first_step + offset, step, self.now)
        if completed:
            self.programs_completed += 1
        await self.release(plan.program_id)

    async def send_step(
        self, url: str, plan: ProgramPlan, step_index: int, messages: list[dict[str, str]], step: StepPlan
    ) -> tuple[StepRecord, str]:
        body: dict[str, Any] = {
            "model": self.spec.model,
            "messages": messages,
            "max_tokens": step.completion_tokens,
            "ignore_eos": True,
        }
        if self.target.program_ids:
            body["program_id"] = plan.program_id
        start = self.now()
        try:
            reply = await (self.stream_chat(url, body) if self.spec.stream else self.chat(url, body))
        except httpx.HTTPError as exc:
            reply = _Reply(status=0, error=f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            self.steps_cancelled += 1
            raise
        record = StepRecord(
            program_id=plan.program_id,
            program_index=plan.index,
            step=step_index,
            start_s=start,
            latency_s=self.now() - start,
            ok=reply.status == 200 and reply.error is None,
            status=reply.status,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
            ttft_s=reply.ttft_s,
            error=reply.error,
        )
        return record, reply.text

    async def chat(self, url: str, body: dict[str, Any]) -> _Reply:
        response = await self.client.post(f"{url}/v1/chat/completions", json=body, headers=self.target.headers)
        if response.status_code != 200:
            return _Reply(response.status_code, error=response.text[:300])
        try:
            payload = response.json()
            text = payload["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return _Reply(response.status_code, error=f"unreadable response: {exc!r}")
        usage = payload.get("usage") or {}
        return _Reply(200, text, usage.get("prompt_tokens"), usage.get("completion_tokens"))

    async def stream_chat(self, url: str, body: dict[str, Any]) -> _Reply:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        start = time.monotonic()
        reply = _Reply(0)
        parts: list[str] = []
        async with self.client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=self.target.headers) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.error = (await response.aread()).decode(errors="replace")[:300]
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                read_stream_chunk(json.loads(data), reply, parts, time.monotonic() - start)
        reply.text = "".join(parts)
        return reply

    async def release(self, program_id: str) -> None:
        if not self.target.program_ids or program_id not in self.open_programs:
            return
        self.open_programs.discard(program_id)
        try:
            url = f"{self.target.urls[0].rstrip('/')}/programs/release"
            response = await self.client.post(url, json={"program_id": program_id}, headers=self.target.headers)
            response.raise_for_status()
        except httpx.HTTPError:
            self.release_failures += 1


def read_stream_chunk(chunk: dict[str, Any], reply: _Reply, parts: list[str], elapsed_s: float) -> None:
    if "error" in chunk:
        reply.error = str(chunk["error"])[:300]
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            if reply.ttft_s is None:
                reply.ttft_s = elapsed_s
            parts.append(content)
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens")
        reply.completion_tokens = usage.get("completion_tokens")


# --- entry point ---------------------------------------------------------------------


def window_end(spec: LoadSpec, records: Sequence[StepRecord], wall_s: float) -> float:
    """End of the steady window: the deadline of a timed run, else the last step's end."""
    if spec.duration_s is not None and wall_s >= spec.duration_s:
        return spec.duration_s
    return max((r.end_s for r in records), default=wall_s)


async def sample_engines(
    client: httpx.AsyncClient,
    engine_urls: Sequence[str],
    start: Sequence[EngineMetrics],
    loop: ClosedLoop,
    samples: list[CounterSample],
) -> None:
    """Read the engines' counters every sample interval until cancelled."""
    previous = list(start)
    while True:
        await asyncio.sleep(loop.spec.sample_interval_s)
        try:
            current = await scrape_engines(client, engine_urls)
        except httpx.HTTPError:
            continue  # a busy engine answers late; the next interval covers this one
        sample = CounterSample(loop.now(), CacheDelta.between(previous, current))
        samples.append(sample)
        if loop.observer is not None:
            loop.observer.sample(sample)
        previous = current


async def run_load(
    target: Target,
    spec: LoadSpec,
    engine_urls: list[str],
    observer: Observer | None = None,
    engine_key: str | None = None,
    tools: SandboxTools | None = None,
) -> LoadResult:
    """Run closed-loop agent load against `target`; read cache counters from `engine_urls`.

    `engine_urls` are the vLLM servers behind the target (the same as `target.urls` for a
    direct run); the first one also calibrates tokens per word. `engine_key` is their API key.
    `tools`: run tool steps in the cluster's sandboxes instead of sleeping them.
    """
    salt = spec.salt or secrets.token_hex(4)
    limits = httpx.Limits(max_connections=spec.concurrency + 8, max_keepalive_connections=spec.concurrency + 8)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=10.0)
    samples: list[CounterSample] = []
    # trust_env=False: a proxy from the environment must never see loopback benchmark traffic.
    # The engines' key by default; the target's own key, if any, goes with each request to it.
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=False, headers=bearer_headers(engine_key)
    ) as client:
        tokens_per_word = (
            await calibrate_tokens_per_word(client, engine_urls[0], spec.model)
            if engine_urls
            else DEFAULT_TOKENS_PER_WORD
        )
        loop = ClosedLoop(client, target, spec, salt, tokens_per_word, observer, tools)
        before = await scrape_engines(client, engine_urls)
        loop.start_clock()
        samplers = [asyncio.create_task(sample_engines(client, engine_urls, before, loop, samples))]
        if tools is not None:
            samplers.append(asyncio.create_task(tools.sample_every(client, loop.now)))
        try:
            wall_s = await loop.execute()
        finally:
            for sampler in samplers:
                sampler.cancel()
            await asyncio.gather(*samplers, return_exceptions=True)
        after = await scrape_engines(client, engine_urls)
        if tools is not None:
            await tools.settle(client, loop.now)
    tool_records, sandbox_samples, create_failures = tools.drain() if tools is not None else ([], [], 0)
    engines = CacheDelta.between(before, after)
    sampled = CacheDelta()
    for sample in samples:
        sampled = sampled + sample.engines
    # The last interval runs from the last sample to the end, so the samples add up to the run.
    samples.append(CounterSample(wall_s, engines - sampled))
    end = window_end(spec, loop.records, wall_s)
    steady = steady_steps(loop.records, spec.warmup_s, end)
    return LoadResult(
        target=target.name,
        concurrency=spec.concurrency,
        salt=salt,
        tokens_per_word=tokens_per_word,
        wall_s=wall_s,
        window_s=max(0.0, end - spec.warmup_s),
        steps_ok=sum(r.ok for r in loop.records),
        steps_failed=sum(not r.ok for r in loop.records),
        steps_cancelled=loop.steps_cancelled,
        steady_latencies_s=[r.latency_s for r in steady],
        programs_started=loop.programs_started,
        programs_completed=loop.programs_completed,
        engines=engines,
        release_failures=loop.release_failures,
        records=loop.records,
        steady_ttfts_s=[r.ttft_s for r in steady if r.ttft_s is not None],
        samples=samples,
        steps_cut=loop.steps_cut,
        tool_records=tool_records,
        sandbox_samples=sandbox_samples,
        sandbox_create_failures=create_failures,
    )
