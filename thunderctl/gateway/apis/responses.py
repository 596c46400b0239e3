"""The OpenAI Responses API (`/v1/responses`): Codex CLI, the OpenAI Agents SDK.

A request's `input` is a string or a list of items: messages (`input_text` / `output_text` parts),
the model's `function_call`s, the tools' `function_call_output`s, `reasoning` items. In chat's form,
for identity and the prompt's shape, `instructions` is the system message, the model's items between
two others' are one assistant message (its text and its calls, as one answer's output items are), a
call's output is a `tool` message, and reasoning (with its encrypted content) and ids do not count.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictBool, StrictStr

from thunderctl.apiusage import Usage, responses_usage
from thunderctl.gateway.apis.base import Answer, Api, StreamedAnswer
from thunderctl.gateway.apis.chat import _Count
from thunderctl.gateway.identity import Turn
from thunderctl.gateway.requests import text_of

# Items the model wrote: they are the assistant's turn when a client sends them back.
MODEL_ITEMS = frozenset({"function_call", "custom_tool_call", "local_shell_call"})
UNCOUNTED_ITEMS = frozenset({"reasoning", "item_reference", "compaction"})


class ResponsesFields(BaseModel):
    """The fields of a Responses request the gateway acts on, with the types OpenAI documents."""

    input: StrictStr | list[dict[str, Any]] = Field(description="a string or a non-empty array of input items")
    instructions: StrictStr | None = Field(None, description="a string or null")
    stream: StrictBool | None = Field(None, description="true or false")
    max_output_tokens: _Count | None = Field(None, description="a positive integer or null")
    previous_response_id: StrictStr | None = Field(None, description="a response id (a string) or null")
    prompt_cache_key: StrictStr | None = Field(None, description="a string or null")
    store: StrictBool | None = Field(None, description="true or false")


def as_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input or output items in chat's form (see the module's docstring)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            messages.append({"role": "item", "content": item})
            continue
        kind = item.get("type", "message")
        if kind in UNCOUNTED_ITEMS:
            continue
        if kind in MODEL_ITEMS or (kind == "message" and item.get("role") == "assistant"):
            assistant = _assistant(messages)
            if kind == "message":
                assistant["content"] += text_of(item.get("content"))
            else:
                arguments = item.get("arguments", item.get("input", item.get("action")))
                assistant["tool_calls"].append({"function": {"name": item.get("name", kind), "arguments": arguments}})
        elif kind == "message":
            messages.append({"role": item.get("role"), "content": item.get("content")})
        elif kind.endswith("_output"):  # function_call_output, custom_tool_call_output, …
            messages.append({"role": "tool", "content": item.get("output")})
        else:
            messages.append({"role": kind, "content": {k: v for k, v in item.items() if k not in ("id", "call_id")}})
    return messages


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the model's next item belongs to: the last message, if it is one."""
    if not messages or messages[-1].get("role") != "assistant" or "tool_calls" not in messages[-1]:
        messages.append({"role": "assistant", "content": "", "tool_calls": []})
    return messages[-1]


def response_answer(response: dict[str, Any]) -> Answer:
    output = response.get("output")
    messages = as_messages(output) if isinstance(output, list) else []
    message = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    usage = response.get("usage")
    return Answer(responses_usage(usage) if isinstance(usage, dict) else None, message, whole=response)


class ResponseEvents(StreamedAnswer):
    """A Responses stream: its first delta is the first token; `response.completed` (or `.incomplete`,
    `.failed`) carries the whole response."""

    def __init__(self, sent_at: float) -> None:
        super().__init__(sent_at)
        self.response: dict[str, Any] = {}

    def chunk(self, chunk: dict[str, Any], now: float) -> None:
        kind = chunk.get("type")
        if not isinstance(kind, str):
            return
        if self.first_token_at is None and kind.endswith(".delta"):
            self.first_token_at = now
        if isinstance(chunk.get("response"), dict) and kind in ENDING_EVENTS:
            self.response = chunk["response"]

    def answer(self) -> Answer:
        return response_answer(self.response)


ENDING_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesApi(Api):
    name = "responses"
    fields = ResponsesFields
    chained = True
    final_events = tuple(f"event: {event}".encode() for event in sorted(ENDING_EVENTS))

    def program_hints(self, body: dict[str, Any]) -> list[tuple[str, Any]]:
        # Codex CLI's thread id; the OpenAI SDKs pass it through unchanged.
        return [("prompt_cache_key", body.get("prompt_cache_key"))]

    def turn(self, body: dict[str, Any]) -> Turn:
        items = body["input"]
        instructions = body.get("instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        if isinstance(items, str):
            return Turn(messages=[*system, {"role": "user", "content": items}])
        return Turn(messages=[*system, *as_messages(items)])

    def answered(self, body: dict[str, Any]) -> Answer:
        return response_answer(body)

    def own_input(self, body: dict[str, Any]) -> list[Any]:
        """This turn's input as items (a string is the user's message)."""
        items = body["input"]
        return [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items

    def streamed(self, sent_at: float) -> StreamedAnswer:
        return ResponseEvents(sent_at)

    def usage_of(self, chunk: dict[str, Any]) -> Usage | None:
        response = chunk.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        return responses_usage(usage) if isinstance(usage, dict) else None
