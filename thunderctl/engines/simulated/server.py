"""`thunderctl engine sim`: the simulator's engine model behind the part of vLLM's OpenAI API that the
gateway, `bench` and agent clients use, in real time.

Routes: `/v1/chat/completions` and `/v1/completions` (streamed or not, `max_tokens`, `ignore_eos`,
`stream_options.include_usage`), `/v1/responses` (the OpenAI Responses API), `/v1/messages` and
`/v1/messages/count_tokens` (the Anthropic Messages API), `/v1/models`, `/tokenize`, `/health`,
`/metrics` (vLLM's names), `/pause?mode=keep|wait`, `/resume`, `/is_paused` and
`/reset_prefix_cache` as vLLM serves them in dev mode (a weight update; `abort` is not simulated),
and `/sim/stall` (no vLLM has it): POST stops the engine stepping, DELETE starts it again.
An answer is always `max_tokens` long, clamped to what fits `max_model_len` as vLLM clamps it:
the model has no end-of-sequence token, so `ignore_eos` changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from thunderctl.engines.simulated.api import Api, Asked, VllmError, invalid_body, prompt_too_long, unknown_model
from thunderctl.engines.simulated.completions import CompletionsApi, Kind, chat_prompt, text_prompt
from thunderctl.engines.simulated.messages import MessagesApi, anthropic_prompt, token_count
from thunderctl.engines.simulated.metrics import metrics_registry
from thunderctl.engines.simulated.responses import ResponsesApi
from thunderctl.engines.simulated.runner import Generation, RealTimeEngine
from thunderctl.sim.cost import EngineShape, Preset
from thunderctl.sim.engine import Engine
from thunderctl.sim.presets import UnknownPreset, get_preset, preset_names

log = logging.getLogger(__name__)

DEFAULT_PRESET = "h100-tp4-32b"
# Like vLLM's periodic "Engine 000: ..." line, while there is traffic.
LOG_INTERVAL_S = 10.0
SIM_VERSION = "0.32.0-sim"  # the vLLM whose behaviour the engine model follows
# On SIGTERM, requests in flight get this long before the server exits anyway (vLLM does not
# wait for them either).
SHUTDOWN_GRACE_S = 2.0


class SimConfigError(ValueError):
    """Options the simulated engine cannot start with; the message names the option and the fix."""


def setting(default: Any, help: str, **bounds: float) -> Any:
    """A setting's default, its help (`engine sim`'s --help) and its bounds (`min`, checked by the command line)."""
    return field(default=default, metadata={"help": help, "bounds": bounds})


@dataclass(frozen=True)
class SimEngineConfig:
    """Every setting of a simulated worker, declared once: `engine sim`'s options are made from these fields."""

    port: int = setting(8000, "Port to listen on.")
    host: str = setting("127.0.0.1", "Address to listen on (loopback by default).")
    preset: str = setting(DEFAULT_PRESET, f"The worker simulated: {', '.join(preset_names())}.")
    # None: the preset's KV tokens in blocks of block_size.
    kv_blocks: int | None = setting(None, "KV cache blocks (default: the preset's).", min=1)
    block_size: int | None = setting(None, "Tokens per KV block (default: the preset's).", min=1)
    max_model_len: int | None = setting(None, "Longest prompt + answer (default: the preset's).", min=2)
    served_model_name: str = setting("tiny", "The model name clients send.")
    time_scale: float = setting(1.0, "Wall seconds per simulated second of engine time (0: as fast as it can).", min=0)
    stream_interval: int = setting(
        1, "Tokens per streamed chunk past the first, as vLLM's --stream-interval (the last goes at once).", min=1
    )

    def preset_and_shape(self) -> tuple[Preset, EngineShape]:
        try:
            preset = get_preset(self.preset)
        except UnknownPreset as exc:
            raise SimConfigError(f"--preset: {exc}") from None
        base = preset.engine
        block_size = self.block_size or base.block_size
        blocks = self.kv_blocks or base.kv_capacity_tokens // block_size
        max_model_len = self.max_model_len or base.max_model_len
        if self.time_scale < 0:
            raise SimConfigError(f"--time-scale {self.time_scale:g} is negative: give 0 (as fast as possible) or more")
        if blocks < 1 or block_size < 1 or max_model_len < 2:
            raise SimConfigError("--kv-blocks and --block-size must be at least 1, --max-model-len at least 2")
        if max_model_len > blocks * block_size:
            raise SimConfigError(
                f"--max-model-len {max_model_len:,} does not fit a KV cache of {blocks:,} blocks of {block_size} "
                f"({blocks * block_size:,} tokens), as vLLM also refuses: lower --max-model-len or raise --kv-blocks"
            )
        return preset, replace(base, num_gpu_blocks=blocks, block_size=block_size, max_model_len=max_model_len)


async def json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise invalid_body("body", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_body("body", "the request body must be a JSON object")
    return body


async def finished_before_disconnect(generation: Generation, request: Request) -> bool:
    """Wait for the whole answer, or for the client to go away first (False), as vLLM's
    `with_cancellation` does for a request that is not streamed."""
    done = asyncio.ensure_future(generation.done())
    gone = asyncio.ensure_future(disconnected(request))
    await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
    for task in (done, gone):
        task.cancel()
    return generation.finished


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def answer_length(api: Api, asked: Asked, max_model_len: int) -> int:
    """The length the request asks for, or its API's default, clamped to the room max_model_len leaves."""
    length = api.default_tokens if asked.max_tokens is None else asked.max_tokens
    if isinstance(length, bool) or not isinstance(length, int):
        raise VllmError(f"{api.length_param} must be an integer, not {json.dumps(length)[:40]}", param=api.length_param)
    room = min(length, max_model_len - len(asked.prompt))
    if room < 1:
        raise api.no_room(len(asked.prompt), max_model_len, room)
    return room


class SimServer:
    """One simulated worker: the engine model, its step loop and its HTTP routes."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self.preset, self.shape = config.preset_and_shape()
        # The engine is given loop times: its frontend works in them too.
        self.engine = Engine(self.shape, self.preset.cost, frontend=self.preset.frontend.scaled(config.time_scale))
        self.runner = RealTimeEngine(self.engine, config.time_scale, config.stream_interval)
        self.registry: CollectorRegistry = metrics_registry(self.engine, config.served_model_name)
        self.started = int(time.time())
        self.admitting = asyncio.Event()  # cleared while paused: new requests queue, as vLLM queues them
        self.admitting.set()

    def describe(self) -> str:
        shape = self.shape
        return (
            f"simulated {self.preset.name} ({self.preset.summary}) at time scale {self.config.time_scale:g}: "
            f"{shape.num_gpu_blocks:,} KV blocks of {shape.block_size} ({shape.kv_capacity_tokens:,} tokens), "
            f"max_model_len {shape.max_model_len:,}, serving {self.config.served_model_name!r}"
        )

    async def generate(self, request: Request, api: Api) -> Response:
        """Every generation route: read the request as its API puts it, run it, answer in its API's shape."""
        try:
            asked = api.read(await json_body(request))
            if asked.model and asked.model != self.config.served_model_name:
                raise unknown_model(asked.model, self.config.served_model_name)
            if not asked.prompt:
                raise VllmError("The decoder prompt cannot be empty")
            if len(asked.prompt) > self.shape.max_model_len:
                raise prompt_too_long(len(asked.prompt), self.shape.max_model_len)
            max_tokens = answer_length(api, asked, self.shape.max_model_len)
        except VllmError as exc:
            return api.refuse(exc)
        await self.admitting.wait()
        generation = self.runner.submit(asked.prompt, max_tokens, stream=asked.stream)
        reply = api.reply(asked, self.config.served_model_name, max_tokens)
        if asked.stream:
            chunks = reply.stream(generation)
            return StreamingResponse(self._aborted_if_gone(chunks, generation), media_type="text/event-stream")
        if not await finished_before_disconnect(generation, request):
            self.runner.abort(generation)
            return Response(status_code=499)  # nobody reads it: the client is gone
        return JSONResponse(reply.whole(generation))

    async def _aborted_if_gone(self, chunks: AsyncIterator[bytes], generation: Generation) -> AsyncIterator[bytes]:
        """The stream; a client gone mid-answer cancels it (Starlette) and the request is aborted."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.runner.abort(generation)

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, CompletionsApi(Kind.CHAT))

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, CompletionsApi(Kind.TEXT))

    async def responses(self, request: Request) -> Response:
        return await self.generate(request, ResponsesApi())

    async def messages(self, request: Request) -> Response:
        return await self.generate(request, MessagesApi())

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's messages.count_tokens, as vLLM serves it: the prompt's tokens."""
        api = MessagesApi()
        try:
            count = len(anthropic_prompt(await json_body(request)))
        except VllmError as exc:
            return api.refuse(exc)
        return JSONResponse(token_count(count))

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await json_body(request)
            tokens = chat_prompt(body) if "messages" in body else text_prompt(body)
        except VllmError as exc:
            return exc.response()
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.shape.max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def models(self, _: Request) -> Response:
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "vllm",
            "root": self.preset.name,
            "parent": None,
            "max_model_len": self.shape.max_model_len,
            "permission": [],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, _: Request) -> Response:
        return Response(status_code=200)

    async def stall(self, request: Request) -> Response:
        """POST stalls the engine, DELETE lets it step again; /health and /metrics answer throughout."""
        stalled = request.method == "POST"
        self.runner.stall(stalled)
        log.warning("engine %s (%s /sim/stall)", "stalled: no step runs" if stalled else "steps again", request.method)
        return JSONResponse({"stalled": self.runner.stalled})

    async def pause(self, request: Request) -> Response:
        """vLLM's dev-mode pause: `keep` freezes what runs, `wait` lets it finish first; new requests queue."""
        mode = request.query_params.get("mode", "abort")
        if mode not in ("keep", "wait"):
            return JSONResponse(
                {
                    "error": f"pause mode {mode!r}: the simulated engine pauses with keep or wait (abort is not simulated)"
                },
                status_code=400,
            )
        self.admitting.clear()
        if mode == "wait":
            while self.engine.running or self.engine.waiting:
                await asyncio.sleep(0.01)
        self.runner.stall(True)
        log.warning("engine paused (mode %s)", mode)
        return JSONResponse({"status": "paused"})

    async def resume(self, _: Request) -> Response:
        self.runner.stall(False)
        self.admitting.set()
        log.warning("engine resumed")
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, _: Request) -> Response:
        return JSONResponse({"is_paused": not self.admitting.is_set()})

    async def reset_prefix_cache(self, _: Request) -> Response:
        self.runner.block_ids.forget()
        log.warning("prefix cache reset")
        return JSONResponse({"success": True})

    async def version(self, _: Request) -> Response:
        return JSONResponse({"version": SIM_VERSION})

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/is_paused", self.is_paused, methods=["GET"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
                Route("/sim/stall", self.stall, methods=["POST", "DELETE"]),  # fault tests: a hung engine
            ]
        )

    async def log_stats(self) -> None:
        """Every LOG_INTERVAL_S while anything happened: what vLLM's stat logger says."""
        counters, last = self.engine.counters, (0, 0, 0)
        while True:
            await asyncio.sleep(LOG_INTERVAL_S)
            now = (counters.steps, counters.prefill_tokens, counters.decode_tokens)
            if now == last:
                continue
            rate = [(b - a) / LOG_INTERVAL_S for a, b in zip(last, now)]
            hit = counters.hit_rate
            log.info(
                "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Steps: %.1f/s, Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %s, Preemptions: %d",
                rate[1],
                rate[2],
                rate[0],
                len(self.engine.running),
                len(self.engine.waiting),
                100 * self.engine.kv_usage,
                "-" if hit is None else f"{100 * hit:.1f}%",
                counters.preemptions,
            )
            last = now

    async def serve(self) -> None:
        """Serve until the process is told to stop (SIGINT/SIGTERM, which uvicorn handles)."""
        config = uvicorn.Config(
            self.app(),
            host=self.config.host,
            port=self.config.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        server = uvicorn.Server(config)
        tasks = [
            asyncio.create_task(self.runner.run(), name="sim-steps"),
            asyncio.create_task(self.log_stats(), name="sim-stats"),
        ]

        def stop_if_broken(task: asyncio.Task[None]) -> None:
            # A worker whose engine is dead must not answer /health: it exits, and `up` or the
            # gateway see a dead worker rather than one that accepts requests and never answers.
            if not task.cancelled() and task.exception() is not None:
                log.error("the engine model failed", exc_info=task.exception())
                server.should_exit = True

        for task in tasks:
            task.add_done_callback(stop_if_broken)
        log.info("%s; on http://%s:%d", self.describe(), self.config.host, self.config.port)
        try:
            await server.serve()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
