"""A relayed stream as an ASGI response: Starlette's StreamingResponse, less its task group per request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class RelayedStream(Response):
    """Sends a body as it comes; a client that goes away stops the body where it waits.

    Starlette's StreamingResponse (under uvicorn's ASGI 2.3) runs the body and a disconnect
    listener in an anyio task group per request. Here the request's own task sends the body
    and a plain asyncio task listens, cancelling it on a disconnect; the body (the relay, whose
    `finally` frees the worker's slot) is closed at once either way.
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes],
        status_code: int,
        media_type: str,
        background: BackgroundTask | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.body_iterator = body
        self.status_code = status_code
        self.media_type = media_type
        self.background = background
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.current_task()
        assert sender is not None  # ASGI apps run in a task
        listener = asyncio.create_task(stop_on_disconnect(receive, sender))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not listener.done() or listener.cancelled():
                raise  # cancelled from outside: the server's shutdown
            sender.uncancel()  # the client went away: the response is over, as Starlette's would be
        finally:
            # Nothing is awaited between the last send and this: a listener woken by the end of the
            # response (uvicorn then answers `http.disconnect` too) is cancelled before it runs.
            listener.cancel()
            await self.body_iterator.aclose()
        if self.background is not None:
            await self.background()


async def stop_on_disconnect(receive: Receive, sender: asyncio.Task[object]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    sender.cancel()
