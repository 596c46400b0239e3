"""Closed-loop agent load: the driver that runs programs whose context grows step by step, like a coding agent.

Each of `concurrency` slots runs one program at a time and starts the next when it ends.
A program sends its whole history every step (a shared system prompt, its task, then the
assistant turns and tool observations so far), waits out a tool call, and repeats. What the
programs look like comes from a workload (bench/shapes.py: `AgentShape`'s uniform ranges; the
`swe-lite` generator; a recorded trace); each gives a program as a trace (prompt and answer
sizes per step, tool times), which bench/planning.py renders as text of those sizes, sent in the
request shape of the API the agents speak (bench/apis.py: chat completions, Responses, Messages). The
same load can go straight to vLLM servers ("direct", each program sticky to one server, or each
request to the next server) or through the thunderctl gateway ("gateway", with `program_id`
on every request and a release at the end, or as a `Client` that names or releases nothing), so
the two can be compared on equal terms. What a
run recorded, and the figures drawn from it, are bench/results.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

import httpx

from thunderctl.bench.apis import SHAPES, Api
from thunderctl.bench.planning import ProgramPlan, StepPlan, plan_program, system_prompt, word_text
from thunderctl.bench.requests import Reply, ask, ask_streamed, error_text, resend_unanswered
from thunderctl.bench.results import (
    CacheDelta,
    CounterSample,
    LoadResult,
    ProgramRun,
    ReleaseFailure,
    Resend,
    StepRecord,
    steady_programs,
    steady_steps,
)
from thunderctl.bench.sandboxes import SandboxTools
from thunderctl.bench.shapes import AgentShape, Workload
from thunderctl.engines.vllm import EngineMetrics, fetch_metrics
from thunderctl.gateway.requests import GROUP_HEADER
from thunderctl.jsonapi import bearer_headers
from thunderctl.sim.agents import Client, aged_start_fraction

# Used when the engine cannot tokenize for us; real tokenizers give ~1.0-1.3 on these words.
DEFAULT_TOKENS_PER_WORD = 1.0
CALIBRATION_WORDS = 400
T = TypeVar("T")


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
    # The API the agents speak (bench/apis.py): the same history and answer lengths in its request shape.
    api: Api = Api.CHAT
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
    # A request that got no byte of its answer (refused, or its connection closed first: a server
    # that died, a stale keep-alive connection) is sent again for up to this long, as an agent's
    # client retries connection errors (the OpenAI SDK twice by default). One cut after its answer
    # began is never sent again: it fails. 0: every error fails at once.
    retry_unanswered_s: float = 0.0
    # A release is idempotent: one that failed in transport (refused, timed out, cut) is sent again
    # for up to this long before it counts as failed (the gateway would hold the program).
    release_retry_s: float = 60.0
    # How long the client keeps an idle connection for the next request (httpx's default: 5 s). A
    # server must keep it longer, or a request sent as the server closes it fails.
    keepalive_s: float = 5.0
    # Through the gateway: whether the agents name their programs and release them (Client).
    client: Client = Client.NAMED
    # Programs k*G .. k*G+G-1 are the G samples of task k, a GRPO group (`bench rollout`): they
    # share the task's text and, through the gateway, name their group in the GROUP_HEADER.
    # 1: every program is a task of its own, and no group is named.
    samples_per_task: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.programs is None and self.duration_s is None:
            raise ValueError("LoadSpec needs programs, duration_s or both")
        if self.time_scale < 0:
            raise ValueError("time_scale must not be negative")
        if self.keepalive_s <= 0:
            raise ValueError("keepalive_s must be positive (seconds an idle connection is kept)")
        if self.samples_per_task < 1:
            raise ValueError("samples_per_task must be at least 1")


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
        self.program_runs: list[ProgramRun] = []
        self.programs_started = 0
        self.programs_completed = 0
        self.steps_cancelled = 0
        self.steps_cut = 0
        self.release_failures: list[ReleaseFailure] = []
        self.unanswered_retries = 0
        self.resends: list[Resend] = []
        self.open_programs: set[str] = set()
        self._t0 = 0.0
        self._next_index = 0

    def now(self) -> float:
        return time.monotonic() - self._t0

    def start_clock(self) -> None:
        self._t0 = time.monotonic()

    @property
    def names_programs(self) -> bool:
        """Whether requests carry their program's id (so the gateway, not the agent, collects its sandbox)."""
        return self.target.program_ids and self.spec.client.names

    @property
    def releases_programs(self) -> bool:
        return self.target.program_ids and self.spec.client.releases

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
            task=index // self.spec.samples_per_task if self.spec.samples_per_task > 1 else None,
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
            await self.tools.finish(sandbox_id, released=self.names_programs)

    async def run_steps(self, plan: ProgramPlan, messages: list[dict[str, str]], sandbox_id: str | None) -> None:
        if self.releases_programs:
            self.open_programs.add(plan.program_id)
        completed = True
        sent: list[StepRecord] = []
        for offset, step in enumerate(plan.steps):
            url = self.target.url_for(plan.index)
            record, text = await self.send_step(url, plan, plan.first_step + offset, messages, step)
            self.records.append(record)
            sent.append(record)
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
            start = sent[0].start_s
            self.program_runs.append(
                ProgramRun(plan.program_id, start, sent[-1].end_s - start, len(sent), plan.first_step == 0)
            )
        await self.release(plan.program_id)

    async def send_step(
        self, url: str, plan: ProgramPlan, step_index: int, messages: list[dict[str, str]], step: StepPlan
    ) -> tuple[StepRecord, str]:
        shape = SHAPES[self.spec.api]
        body = shape.body(self.spec.model, messages, step.completion_tokens)
        headers = self.target.headers
        if self.names_programs:
            body["program_id"] = plan.program_id
            if plan.group_id is not None:
                headers[GROUP_HEADER] = plan.group_id
        start = self.now()
        try:
            reply = await self.retrying_unanswered(
                lambda: (ask_streamed if self.spec.stream else ask)(self.client, url, shape, body, headers)
            )
        except httpx.HTTPError as exc:
            reply = Reply(status=0, error=error_text(exc))
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

    async def retrying_unanswered(self, send: Callable[[], Awaitable[T]]) -> T:
        return await resend_unanswered(send, self.spec.retry_unanswered_s, self.count_retry)

    def count_retry(self, exc: Exception) -> None:
        self.unanswered_retries += 1
        self.resends.append(Resend(self.now(), error_text(exc)))

    async def release(self, program_id: str) -> None:
        if not self.releases_programs or program_id not in self.open_programs:
            return
        url = f"{self.target.urls[0].rstrip('/')}/programs/release"

        async def send() -> None:
            response = await self.client.post(url, json={"program_id": program_id}, headers=self.target.headers)
            response.raise_for_status()

        try:
            await resend_unanswered(send, self.spec.release_retry_s, self.count_retry, retry_on=(httpx.TransportError,))
        except httpx.HTTPError as exc:
            self.release_failures.append(ReleaseFailure(program_id, self.now(), error_text(exc)))
        # Open until answered or given up: a release cut off by the deadline is sent again at the end
        # (the soak found programs left that had ended just before it, their release cancelled).
        self.open_programs.discard(program_id)


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
    limits = httpx.Limits(
        max_connections=spec.concurrency + 8,
        max_keepalive_connections=spec.concurrency + 8,
        keepalive_expiry=spec.keepalive_s,
    )
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
    completed = steady_programs(loop.program_runs, spec.warmup_s, end)
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
        release_failures=len(loop.release_failures),
        release_errors=loop.release_failures,
        records=loop.records,
        steady_ttfts_s=[r.ttft_s for r in steady if r.ttft_s is not None],
        samples=samples,
        steps_cut=loop.steps_cut,
        unanswered_retries=loop.unanswered_retries,
        resends=loop.resends,
        tool_records=tool_records,
        sandbox_samples=sandbox_samples,
        sandbox_create_failures=create_failures,
        program_runs=loop.program_runs,
        steady_programs_completed=len(completed),
        steady_program_s=[run.latency_s for run in completed if run.whole],
    )
