"""The gateway's HTTP to its workers: httpx's API over aiohttp's connection pool and C parser.

Every streamed token crosses this hop. httpx's own transport (httpcore over anyio, h11) spends
several times aiohttp's CPU per read and scans its whole pool on every request, and one
gateway process relays thousands of streams; so the gateway keeps httpx's client (its
requests, errors, timeouts and the tests' MockTransport seam) and reads through aiohttp.
A read hands on everything that has arrived, so a stream that fell behind catches up in one
write to the client rather than one per chunk. Fewer, larger chunks come from the workers
themselves (the profile's engine.stream_interval, vLLM's --stream-interval).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx

from thunderctl.jsonapi import bearer_headers

# A pooled connection can be closed by the worker just as it is reused: its keep-alive ran out
# while the gateway, behind on a busy loop, had not yet read the end of the previous answer. The
# request did not get an answer's first byte; it goes again on another connection (as browsers
# retry a stale keep-alive connection), and only a worker that cannot be reached is an error.
STALE_RETRIES = 2
# Connection management is aiohttp's; httpx would send these for its own.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "content-length", "transfer-encoding"})
EVENT_STREAM = "text/event-stream"


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
    """A response body as it arrives; closing it before the end closes the connection (the worker aborts)."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # readany() itself rather than iter_any(), its iterator: one layer less to pass per read.
        content = self._response.content
        try:
            while data := await content.readany():
                yield data
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise translated(exc, self._request) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Unlimited connections, idle ones dropped after `keepalive_s`; no redirects, bodies left encoded
    (httpx decodes them, as with its own transport). httpx's connect and read timeouts apply
    (read: the longest wait for the next bytes)."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
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
            stream=AiohttpStream(response, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def worker_client(
    transport: httpx.AsyncBaseTransport, worker_key: str | None, connect_timeout_s: float
) -> httpx.AsyncClient:
    """The client of every call to a worker (relay, health, metrics): the cluster's worker key, a
    bounded connect, and no read timeout (an answer streams as long as it takes)."""
    return httpx.AsyncClient(
        headers=bearer_headers(worker_key), timeout=httpx.Timeout(None, connect=connect_timeout_s), transport=transport
    )
