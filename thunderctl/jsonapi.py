"""The JSON error shape, bounded body parsing and the program id rule shared by every HTTP API
of thunderctl (gateway, sandboxes, control socket), so a client sees one OpenAI-style error
format everywhere and no request body can exhaust memory or the parser's stack."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Far deeper than any OpenAI request (tool schemas included), far below the ~1,000 levels
# at which Python's json parser gives up with a RecursionError.
DEFAULT_MAX_JSON_DEPTH = 64
MAX_PROGRAM_ID_CHARS = 256
MAX_CONTAINER_REF_CHARS = 256  # a container's full id is 64 hex digits; names are shorter in practice


class BadRequest(ValueError):
    """The client's request cannot be served as sent; the message says why."""

    status = 400


class BodyTooLarge(BadRequest):
    status = 413


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_depth: int = DEFAULT_MAX_JSON_DEPTH


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def bad_request(exc: BadRequest) -> JSONResponse:
    return error(exc.status, str(exc))


def bearer_headers(key: str | None) -> dict[str, str]:
    """What a client of a keyed API (the gateway, a vLLM worker) sends; nothing without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return "an object"


def shown(value: Any) -> str:
    """A value as an error message quotes it: a number itself, anything else by its JSON type
    (a string could be megabytes long)."""
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else json_type(value)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed `max_bytes`: from its
    Content-Length before reading, or while its chunks arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"request body is {int(declared)} bytes; the limit is {max_bytes} (gateway.max_body_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"request body exceeds the limit of {max_bytes} bytes (gateway.max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def nesting_depth(value: Any) -> int:
    """How deep arrays and objects nest (a scalar is 0); iterative, so any input is safe. Level by
    level, containers only: every request's body goes through it, and most of a chat's values
    are strings."""
    depth, level = 0, [value] if isinstance(value, dict | list) else []
    while level:
        depth += 1
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
    return depth


async def read_json_object(request: Request, limits: BodyLimits = BodyLimits()) -> dict:
    return (await read_json_body(request, limits))[1]


async def read_json_options(request: Request, limits: BodyLimits = BodyLimits()) -> dict:
    """A body of optional fields (`/admin/pause`, `/shutdown`): an empty body is `{}`, any other
    is read as `read_json_object` reads it, within `limits` as it arrives."""
    raw = await read_body(request, limits.max_bytes)
    return parse_json_object(raw, limits) if raw else {}


async def read_json_body(request: Request, limits: BodyLimits = BodyLimits()) -> tuple[bytes, dict]:
    """The body as sent, and parsed (a JSON object within `limits`, else a BadRequest)."""
    raw = await read_body(request, limits.max_bytes)
    return raw, parse_json_object(raw, limits)


def parse_json_object(raw: bytes, limits: BodyLimits) -> dict:
    """`raw` parsed: a JSON object nested no deeper than `limits.max_depth`, else a BadRequest."""
    too_deep = f"request body nests arrays/objects deeper than {limits.max_depth} levels"
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(too_deep) from None
    except (ValueError, UnicodeDecodeError) as exc:  # also an integer too long to convert
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {json_type(body)}")
    if nesting_depth(body) > limits.max_depth:
        raise BadRequest(too_deep)
    return body


def valid_program_id(value: Any, where: str = "program_id") -> str:
    """A program id as thunderctl keeps it: 1-256 printable characters (an integer is read as
    its digits). `where` names the field in the error."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BadRequest(f"{where} must be a string, not {json_type(value)}")
    text = str(value)
    if not 0 < len(text) <= MAX_PROGRAM_ID_CHARS:
        raise BadRequest(f"{where} must be 1-{MAX_PROGRAM_ID_CHARS} characters, not {len(text)}")
    if not text.isprintable():
        raise BadRequest(f"{where} must be printable characters (no control characters or line breaks)")
    return text
