"""The gateway's HTTP to its workers: httpx's API over aiohttp's connection pool and C parser.

Every streamed token crosses this hop. httpx's own transport (httpcore over anyio, h11) spends
several times aiohttp's CPU per read and scans its whole pool on every request, and one
gateway process relays thousands of streams; so the gateway keeps httpx's client (its
requests, errors, timeouts and the tests' MockTransport seam) and reads through aiohttp.
A read hands on everything that has arrived, so a stream that fell behind catches up in one
write to the client rather than one per chunk; and an event stream that comes faster than
`stream_interval_ms` is read at most that often (RelayConfig), several events a read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
from pydantic import BaseModel, ConfigDict, Field

# A pooled connection can be closed by the worker just as it is reused: its keep-alive ran out
# while the gateway, behind on a busy loop, had not yet read the end of the previous answer. The
# request did not get an answer's first byte; it goes again on another connection (as browsers
# retry a stale keep-alive connection), and only a worker that cannot be reached is an error.
STALE_RETRIES = 2
# Connection management is aiohttp's; httpx would send these for its own.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "content-length", "transfer-encoding"})
EVENT_STREAM = "text/event-stream"


class RelayConfig(BaseModel):
    """How the gateway reads its workers' streamed answers: profile keys under `gateway:`, `serve` options."""

    model_config = ConfigDict(extra="forbid")

    stream_interval_ms: float = Field(
        0.0,
        ge=0,
        description="a streamed answer whose events come faster than this is read from the worker, and "
        "written to the client, at most once per this many ms, all its events since at once (0: every "
        "event as it comes, the default: no gain measured yet); an answer's end reaches the client up to this much later",
    )


def translated(exc: Exception, request: httpx.Request) -> httpx.TransportError:
    """The httpx error the gateway (and anything written against httpx) expects for an aiohttp one."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


class AiohttpStream(httpx.AsyncByteStream):
    """A response body as it arrives; closing it before the end closes the connection (the worker aborts).

    With `interval_s`, a read that came sooner than that after the one before is followed by a
    rest, with the connection's reading paused: the events of the rest wait in the kernel's socket
    buffer and come in one read after it. Every event costs the gateway a wake-up, a read, a pass
    through the relay and a write to the client (the client a read); on a worker that streams a
    token to each of many answers every few ms, those per-event costs are most of the gateway's
    CPU. Rests end on a grid of `interval_s` shared by every stream, so the streams resting at once
    wake the process once between them, not once each (on an engine sharing the gateway's cores,
    every wake-up takes a core from it). A stream slower than `interval_s` is never held back.
    """

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request, interval_s: float = 0.0) -> None:
        self._response = response
        self._request = request
        self._interval_s = interval_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # readany() itself rather than iter_any(), its iterator: one layer less to pass per read.
        content, previous = self._response.content, None
        try:
            while data := await content.readany():
                if not self._interval_s:
                    yield data
                    continue
                now = time.monotonic()
                yield data
                if previous is not None and now - previous < self._interval_s:
                    await self._rest()
                previous = now
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise translated(exc, self._request) from exc

    async def _rest(self) -> None:
        connection = self._response.connection
        if connection is None or connection.protocol is None:
            return  # the answer has all arrived (the connection is back in the pool)
        protocol = connection.protocol
        protocol.pause_reading()
        try:
            now = time.monotonic()
            await asyncio.sleep(self._interval_s - now % self._interval_s)  # to the next point of the grid
        finally:
            if protocol.transport is not None:
                protocol.resume_reading()

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Unlimited connections, idle ones dropped after `keepalive_s`; no redirects, bodies left encoded
    (httpx decodes them, as with its own transport). httpx's connect and read timeouts apply
    (read: the longest wait for the next bytes). An event stream is read at most every
    `stream_interval_s` (AiohttpStream)."""

    def __init__(self, keepalive_s: float, stream_interval_s: float = 0.0) -> None:
        self.keepalive_s = keepalive_s
        self.stream_interval_s = stream_interval_s  # see AiohttpStream
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        # Made on first use: aiohttp binds its session to the running event loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read"))
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in HOP_BY_HOP]
        body = await request.aread() or None
        for attempt in range(1, STALE_RETRIES + 2):
            try:
                response = await self._open_session().request(
                    request.method, str(request.url), headers=headers, data=body, allow_redirects=False, timeout=timeout
                )
                break
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError) or attempt > STALE_RETRIES:
                    raise translated(exc, request) from exc
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise translated(exc, request) from exc
        return httpx.Response(
            response.status,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers],
            stream=AiohttpStream(response, request, self._interval(response)),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    def _interval(self, response: aiohttp.ClientResponse) -> float:
        """Only an event stream is paced: a whole body read in several reads is wanted at once."""
        return self.stream_interval_s if response.content_type == EVENT_STREAM else 0.0

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
