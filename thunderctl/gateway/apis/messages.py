"""The Anthropic Messages API (`/v1/messages`): Claude Code, the Anthropic SDK.

In chat's form, for identity and the prompt's shape, `system` is the system message, an assistant
message is its text blocks and its `tool_use` blocks as tool calls (thinking blocks and their
signatures do not count), and a user message's `tool_result` blocks are `tool` messages; block ids
and `cache_control` (which Claude Code moves from turn to turn) do not count.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field, StrictBool, StrictStr
from starlette.responses import JSONResponse

from thunderctl.apiusage import Usage, messages_usage
from thunderctl.gateway.apis.base import Answer, Api, StreamedAnswer
from thunderctl.gateway.apis.chat import _Count
from thunderctl.gateway.identity import Turn
from thunderctl.gateway.requests import text_of

UNCOUNTED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# The gateway's refusals by status, as Anthropic names them (its clients show the message).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 502: "api_error"}  # fmt: skip


class MessagesFields(BaseModel):
    """The fields of a Messages request the gateway acts on, with the types Anthropic documents."""

    messages: list[dict[str, Any]] = Field(min_length=1, description="a non-empty array of {role, content} objects")
    system: StrictStr | list[dict[str, Any]] | None = Field(None, description="a string or an array of text blocks")
    max_tokens: _Count = Field(description="a positive integer")
    stream: StrictBool | None = Field(None, description="true or false")
    metadata: dict[str, Any] | None = Field(None, description="an object or null")


def as_message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Messages message in chat's form: one message, and a tool message per tool result."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content}]
    blocks = [b for b in content if isinstance(b, dict) and b.get("type") not in UNCOUNTED_BLOCKS]
    results = [{"role": "tool", "content": text_of(b.get("content"))} for b in blocks if b.get("type") == "tool_result"]
    calls = [
        {"function": {"name": b.get("name"), "arguments": b.get("input")}}
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    text = text_of([b for b in blocks if b.get("type") == "text"])
    others = [json.dumps({k: v for k, v in b.items() if k != "cache_control"}, sort_keys=True)
              for b in blocks if b.get("type") not in ("text", "tool_use", "tool_result")]  # fmt: skip
    own = {"role": role, "content": text + "".join(others)}
    if role == "assistant":
        own["tool_calls"] = calls
    elif results and not (text or others):  # a user turn of tool results alone
        return results
    return [*results, own]


def message_answer(content: list[Any], usage: dict[str, Any] | None) -> Answer:
    messages = as_message({"role": "assistant", "content": content})
    return Answer(messages_usage(usage) if usage else None, messages[-1])


class MessageEvents(StreamedAnswer):
    """A Messages stream: content blocks started, then filled by deltas (text, or a tool's input as
    JSON in pieces)."""

    def __init__(self, sent_at: float) -> None:
        super().__init__(sent_at)
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}

    def chunk(self, chunk: dict[str, Any], now: float) -> None:
        kind, index = chunk.get("type"), chunk.get("index")
        if kind == "content_block_start" and isinstance(chunk.get("content_block"), dict):
            self._blocks[index] = dict(chunk["content_block"])
        elif kind == "content_block_delta" and isinstance(chunk.get("delta"), dict):
            if self.first_token_at is None:
                self.first_token_at = now
            delta, block = chunk["delta"], self._blocks.setdefault(index, {"type": "text", "text": ""})
            if isinstance(delta.get("text"), str):
                block["text"] = block.get("text", "") + delta["text"]
            if isinstance(delta.get("partial_json"), str):
                self._json.setdefault(index, []).append(delta["partial_json"])

    def answer(self) -> Answer:
        blocks = []
        for index, block in sorted(self._blocks.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else 0):
            if index in self._json:
                block = {**block, "input": "".join(self._json[index])}
            blocks.append(block)
        return message_answer(blocks, None)


class MessagesApi(Api):
    name = "messages"
    final_events = (b"event: message_stop",)
    fields = MessagesFields

    def program_hints(self, body: dict[str, Any]) -> list[tuple[str, Any]]:
        return [("metadata.user_id's session", session_of(body.get("metadata")))]

    def turn(self, body: dict[str, Any]) -> Turn:
        system = body.get("system")
        messages = [{"role": "system", "content": text_of(system)}] if system else []
        for message in body["messages"]:
            messages.extend(as_message(message))
        return Turn(messages=messages)

    def answered(self, body: dict[str, Any]) -> Answer:
        content = body.get("content")
        usage = body.get("usage")
        return message_answer(content if isinstance(content, list) else [], usage if isinstance(usage, dict) else None)

    def streamed(self, sent_at: float) -> StreamedAnswer:
        return MessageEvents(sent_at)

    def usage_of(self, chunk: dict[str, Any]) -> Usage | None:
        message = chunk.get("message")
        usage = (message if isinstance(message, dict) else chunk).get("usage")
        return messages_usage(usage) if isinstance(usage, dict) else None

    def error(self, status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def session_of(metadata: Any) -> str | None:
    """The session Claude Code names in `metadata.user_id`: a JSON object's `session_id`, or the
    `..._session_<id>` of its older form."""
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user, str):
        return None
    try:
        parsed = json.loads(user)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        session = parsed.get("session_id")
        return session if isinstance(session, str) and session else None
    _, found, session = user.rpartition("_session_")
    return session or None if found else None
