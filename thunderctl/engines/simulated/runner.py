"""The simulator's engine model in real time: it steps on the asyncio loop, each step lasting its
cost-model time × `time_scale` of wall time, and a request's tokens come out as its steps sample them.

A request that arrives mid-step is scheduled at the next step boundary, as on the simulator's
virtual clock (sim/worker.py). The time Python spends around a step counts towards it: the
next step starts when the step's time is up, not that long after its work was done.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from thunderctl.engines.simulated.tokens import BlockIds, ContentStream, answer_words, token_ids
from thunderctl.sim.engine import Engine, Request

IDS_PER_CACHED_BLOCK = 4


@dataclass(eq=False)
class Generation:
    """One request being answered: its engine request and the words of its answer."""

    request: Request
    words: list[str]
    block_size: int
    stream_interval: int = 1  # vLLM's --stream-interval: tokens a streamed piece waits for, past the first
    _progress: asyncio.Event = field(default_factory=asyncio.Event)
    _finished: bool = False
    _sampled: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.words)

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held when the engine first took it (0 before that)."""
        return self.request.cached_tokens or 0

    @property
    def cache_write_tokens(self) -> int:
        """Prompt tokens it wrote to the prefix cache: the full blocks of its prompt the cache did not hold."""
        return max(0, self.prompt_tokens // self.block_size * self.block_size - self.cached_tokens)

    def advance(self, sampled: int) -> None:
        if sampled > self._sampled:
            self._sampled = sampled
            self._progress.set()

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> None:
        self._finished = True
        self._sampled = len(self.words)
        self._progress.set()

    async def done(self) -> None:
        while not self._finished:
            self._progress.clear()
            await self._progress.wait()

    async def pieces(self) -> AsyncIterator[tuple[list[str], bool]]:
        """The answer's words as steps sample them (several at once if the reader fell behind),
        each with whether it ends the answer. As vLLM's output processor: the first token and the
        last go at once, the rest in pieces of at least `stream_interval` tokens."""
        sent = 0
        while True:
            if not self._due(sent):
                self._progress.clear()
                await self._progress.wait()
            upto = self._sampled
            if self._due(sent):
                yield self.words[sent:upto], self._finished and upto == len(self.words)
                sent = upto
            if self._finished and sent == len(self.words):
                return

    def _due(self, sent: int) -> bool:
        if self._finished:
            return True
        return self._sampled > sent and (sent == 0 or self._sampled - sent >= self.stream_interval)


class RealTimeEngine:
    """Owns an `Engine` and its step loop; `submit` from request handlers, `run` as a task."""

    def __init__(self, engine: Engine, time_scale: float, stream_interval: int = 1) -> None:
        self.engine = engine
        self.time_scale = time_scale
        self.stream_interval = stream_interval
        self._streaming: set[Generation] = set()
        self._aborted: list[Request] = []  # to leave the engine at the next step boundary
        self._in_frontend: set[Request] = set()  # not in the engine yet: the frontend has their prompts
        self._work = asyncio.Event()
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        # Contents remembered: a few times what the cache holds, so a cached block is not forgotten.
        self.block_ids = BlockIds(capacity=IDS_PER_CACHED_BLOCK * engine.shape.num_gpu_blocks)

    def submit(self, prompt: Sequence[int], max_tokens: int, *, stream: bool) -> Generation:
        """Queue a request; the caller checked that prompt + max_tokens fits max_model_len."""
        words = answer_words(prompt, max_tokens)
        tokens = [*prompt, *token_ids(" ".join(words))]
        content = ContentStream.of(tokens, self.engine.block_size, self.block_ids)
        request = Request(
            content, prompt_tokens=len(prompt), max_tokens=max_tokens, arrival_s=asyncio.get_running_loop().time()
        )
        generation = Generation(request, words, self.engine.block_size, self.stream_interval)
        request.on_finish = lambda _: self._finished(generation)
        if stream:
            self._streaming.add(generation)
        # The API server's work on the prompt comes first (sim/engine.py, FrontendCost).
        delay = self.engine.frontend_in_s(request, request.arrival_s) - request.arrival_s
        self._in_frontend.add(request)
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._enter, request)
        else:
            self._enter(request)
        return generation

    def _enter(self, request: Request) -> None:
        if request not in self._in_frontend:
            return  # its client went away before it reached the engine
        self._in_frontend.discard(request)
        self.engine.submit(request)
        self._work.set()

    def abort(self, generation: Generation) -> None:
        """Its client went away: the request leaves the engine at the next step boundary (a step
        in flight computes it still), its blocks freed. Nothing happens to a finished one."""
        self._streaming.discard(generation)
        if generation.request in self._in_frontend:
            self._in_frontend.discard(generation.request)
        elif not generation.finished:
            self._aborted.append(generation.request)
            self._work.set()  # an idle loop (a request that cannot be scheduled) wakes to drop it

    @property
    def stalled(self) -> bool:
        return not self._unstalled.is_set()

    def stall(self, stalled: bool) -> None:
        """Stop stepping at the next step boundary (requests queue, none progresses), or step again:
        a hung engine whose HTTP server still answers, for fault tests."""
        if stalled:
            self._unstalled.clear()
        else:
            self._unstalled.set()

    def _finished(self, generation: Generation) -> None:
        self._streaming.discard(generation)
        loop = asyncio.get_running_loop()
        now = loop.time()
        delay = self.engine.frontend_out_s(now) - now
        if delay > 0:
            loop.call_later(delay, generation.finish)
        else:
            generation.finish()

    async def run(self) -> None:
        """Step while there is work, sleep until a request arrives otherwise; until cancelled."""
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            await self._unstalled.wait()
            for request in self._aborted:
                engine.abort(request)
            self._aborted.clear()
            start = loop.time()
            seconds = engine.begin_step(start)
            if seconds is None:
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep(max(0.0, start + seconds * self.time_scale - loop.time()))
            engine.end_step(loop.time())  # finished requests' callbacks run here
            for generation in self._streaming:
                generation.advance(engine.sampled_tokens(generation.request))
