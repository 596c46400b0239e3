"""The JSON error shape and body parsing shared by every HTTP API of thunderctl (gateway,
sandboxes, control socket), so a client sees one OpenAI-style error format everywhere."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse


class BadRequest(ValueError):
    """The client's request cannot be served as sent; the message says why."""


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


async def read_json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body
