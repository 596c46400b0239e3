"""Clients that go away while sending a request's body: counted and logged in one line.

Starlette raises `ClientDisconnect` from the body read; unhandled, the server logs a traceback
for what is the client's doing, not a fault of the gateway. Nobody is left to answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)


class CountDisconnects:
    """ASGI middleware: a `ClientDisconnect` from the app ends the request quietly; `on_disconnect`
    counts it and returns the count so far, for the log line."""

    def __init__(self, app: ASGIApp, on_disconnect: Callable[[], int]) -> None:
        self.app = app
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            count = self.on_disconnect()
            log.info("client went away mid-body: %s %s (%d so far)", scope.get("method"), scope.get("path"), count)
