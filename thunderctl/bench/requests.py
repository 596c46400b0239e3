"""One agent request over HTTP in its API's shape (streamed or not), what its answer gave, and resending one that got no byte."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import tenacity

from thunderctl.bench.apis import ApiShape, Event

T = TypeVar("T")
# A request that got no byte of its answer is sent again after this wait, doubled after each try up to
# the cap (while `retry_unanswered_s` lasts), each wait drawn from its upper half: thousands of agents
# that lost their connections at once do not all come back at once (the OpenAI SDK backs off alike).
UNANSWERED_RETRY_INTERVAL_S = 0.25
UNANSWERED_RETRY_MAX_S = 2.0
# How a request can end with no byte of its answer: refused, not connected in time, no pooled connection
# free in time, or its connection closed before the answer (the OpenAI SDK retries all of these).
UNANSWERED_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


class AnswerCut(httpx.TransportError):
    """The connection ended after the answer had begun: the server acted on the request, so it is
    never sent again."""


@dataclass
class Reply:
    """What one request's answer gave (status, text, usage, time to first token), or why it failed."""

    status: int
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    error: str | None = None


async def resend_unanswered(
    send: Callable[[], Awaitable[T]],
    for_s: float,
    on_resend: Callable[[Exception], None],
    retry_on: tuple[type[Exception], ...] = UNANSWERED_ERRORS,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """`send()`, sent again (backing off) for up to `for_s` after its first error while it fails with one of
    `retry_on` (by default: got no byte of its answer); `on_resend` is told each error that was retried.
    The time counts from the first error, not the first send: on a loop running late one attempt alone
    can take longer than `for_s`, and it is then sent again all the same."""
    first_error_at: float | None = None

    def out_of_time(state: tenacity.RetryCallState) -> bool:
        nonlocal first_error_at
        now = time.monotonic()
        first_error_at = first_error_at or now
        return now + state.upcoming_sleep > first_error_at + for_s

    def told(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None  # tenacity calls before_sleep after a failed attempt
        on_resend(typing.cast(Exception, state.outcome.exception()))

    # Doubling waits capped at UNANSWERED_RETRY_MAX_S, each drawn from its upper half: the fixed lower
    # half plus a random draw below it.
    half = tenacity.wait_exponential(multiplier=UNANSWERED_RETRY_INTERVAL_S / 2, max=UNANSWERED_RETRY_MAX_S / 2)
    jitter = tenacity.wait_random_exponential(
        multiplier=UNANSWERED_RETRY_INTERVAL_S / 2, max=UNANSWERED_RETRY_MAX_S / 2
    )
    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(retry_on) & tenacity.retry_if_not_exception_type(AnswerCut),
        wait=half + jitter,
        stop=out_of_time,
        before_sleep=told,
        reraise=True,
        sleep=sleep,
    )

    async def attempt() -> T:  # tenacity awaits only a coroutine function's result; `send` may be a lambda
        return await send()

    return await retrying(attempt)


async def ask(
    client: httpx.AsyncClient, url: str, shape: ApiShape, body: dict[str, Any], headers: dict[str, str]
) -> Reply:
    """One request in `shape`'s API, its answer read whole."""
    async with client.stream("POST", f"{url}{shape.path}", json=body, headers=headers) as response:
        with answer_begun():
            await response.aread()
    if response.status_code != 200:
        return Reply(response.status_code, error=response.text[:300])
    try:
        text, usage = shape.answer(response.json())
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return Reply(response.status_code, error=f"unreadable response: {exc!r}")
    return Reply(200, text, usage.get("prompt_tokens"), usage.get("completion_tokens"))


async def ask_streamed(
    client: httpx.AsyncClient, url: str, shape: ApiShape, body: dict[str, Any], headers: dict[str, str]
) -> Reply:
    """One request in `shape`'s API, streamed: its text, its usage and when its first token came."""
    start = time.monotonic()
    reply = Reply(0)
    parts: list[str] = []
    async with client.stream("POST", f"{url}{shape.path}", json=shape.streamed(body), headers=headers) as response:
        reply.status = response.status_code
        with answer_begun():
            if response.status_code != 200:
                reply.error = (await response.aread()).decode(errors="replace")[:300]
                return reply
            async for line in sse_lines(response):
                if not line.startswith(b"data:"):
                    continue  # the event's name, if any: its data names its type too
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                take_event(shape.event(json.loads(data)), reply, parts, time.monotonic() - start)
    reply.text = "".join(parts)
    return reply


async def sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """An event stream's lines. Not httpx's `aiter_lines`: it also splits at U+2028, U+0085 and
    the like, which JSON leaves unescaped inside strings, so a chunk whose text holds one would be
    cut in two (a random token of the tiny model did that)."""
    pending = b""
    async for data in response.aiter_bytes():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r")
    if pending:
        yield pending


@contextlib.contextmanager
def answer_begun() -> Iterator[None]:
    """Reading an answer whose status line came: a transport error now is an AnswerCut."""
    try:
        yield
    except AnswerCut:
        raise
    except httpx.TransportError as exc:
        raise AnswerCut(error_text(exc)) from exc


def error_text(exc: BaseException) -> str:
    """How a failed request or release is reported: the exception's type, then its message."""
    return f"{type(exc).__name__}: {exc}"


def take_event(event: Event, reply: Reply, parts: list[str], elapsed_s: float) -> None:
    """One stream event into the reply: its text (the first text is the first token), usage and error."""
    if event.error is not None:
        reply.error = event.error[:300]
    if event.text:
        if reply.ttft_s is None:
            reply.ttft_s = elapsed_s
        parts.append(event.text)
    if event.usage:
        reply.prompt_tokens = event.usage.get("prompt_tokens", reply.prompt_tokens)
        reply.completion_tokens = event.usage.get("completion_tokens", reply.completion_tokens)
