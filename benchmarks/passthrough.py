"""A pass-through HTTP proxy: every request to the upstream as it came, every answer back as it comes.

No parsing, no scheduling, no bookkeeping: what any gateway in front of an engine costs at the
least (one more process, one more hop, each streamed chunk read and written once). Run as a
baseline arm (`swe_lite_compare.py --baseline proxy`), it splits a gateway's cost against vLLM
alone into the hop's and the gateway's own.

    python benchmarks/passthrough.py --upstream http://127.0.0.1:8000 --port 8001
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

# Headers that describe one connection, not the message: aiohttp sets its own.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host"})


async def relay(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    url = request.app["upstream"] + request.path_qs
    for attempt in (1, 2):
        try:
            upstream = await session.request(request.method, url, data=body, headers=headers)
            break
        except aiohttp.ServerDisconnectedError:
            # A kept-alive connection the upstream had closed (uvicorn closes idle ones after 5 s):
            # nothing was sent on it, so the request goes again on a new one.
            if attempt == 2:
                raise
    async with upstream:
        response = web.StreamResponse(
            status=upstream.status,
            headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS},
        )
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away (a benchmark slice ended): so does the upstream request
        return response


async def upstream_session(app: web.Application) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        app["session"] = session
        yield


def build_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["upstream"] = upstream.rstrip("/")
    app.cleanup_ctx.append(upstream_session)
    app.router.add_route("*", "/{path:.*}", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="The engine's base URL.")
    parser.add_argument("--port", type=int, required=True, help="Port on 127.0.0.1 to listen on.")
    args = parser.parse_args()
    web.run_app(build_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
