"""The APIs a benchmark's agents speak (`--api`): one shape each, which builds a step's request from
the program's history and reads its answer, whole or one stream event at a time (pure).

The closed loop keeps a program's history in chat's form (the system prompt, the task, then each
answer and observation as assistant and user messages); each API sends that history in its own
request shape, as its harness does, so a program sends the same text and asks for the same answer
lengths whichever API carries it:

- chat completions (`/v1/chat/completions`): the messages as they are; `max_tokens` with vLLM's
  `ignore_eos`, so every answer is as long as the step's.
- Responses (`/v1/responses`, as Codex CLI sends it): the system prompt as `instructions`, every
  other message as a `message` item of one `input_text` part (an answer: an assistant message of
  one `output_text` part), `store: false`; `max_output_tokens` with `ignore_eos`, which vLLM's
  Responses request takes as chat's does.
- Messages (`/v1/messages`, as Claude Code sends it): `system`, then `messages` with string
  contents (an answer's text may be empty, and an empty text block is refused); `max_tokens` alone:
  vLLM's Anthropic request has no `ignore_eos`, so an answer ends early where the model samples its
  end token, and its usage says how long it was.

Every answer's usage is read in chat's terms (`thunderctl.apiusage`): chat's last chunk, Responses'
`response.completed`, Messages' `message_start` and `message_delta`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from thunderctl.apiusage import Usage, messages_usage, responses_usage

Message = dict[str, str]  # {"role", "content"}: a history message in chat's form


class Api(StrEnum):
    """The API the agents speak (`--api`), named as the gateway's API modules name theirs."""

    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"


@dataclass(frozen=True)
class Event:
    """What one stream event tells: the answer's text it adds, its usage (what it says of it), an error."""

    text: str = ""
    usage: Usage | None = None
    error: str | None = None


class ApiShape(ABC):
    """How one API's requests and answers look; see the module's docstring."""

    api: ClassVar[Api]
    path: ClassVar[str]

    @abstractmethod
    def body(self, model: str, history: Sequence[Message], max_tokens: int) -> dict[str, Any]:
        """The request for the next answer (`max_tokens` long) to `history`, not streamed."""

    def streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` asking for a stream (whose usage the API then always sends)."""
        return {**body, "stream": True}

    @abstractmethod
    def answer(self, payload: dict[str, Any]) -> tuple[str, Usage]:
        """A whole answer's text and usage; a KeyError, IndexError or TypeError when it is not this API's."""

    @abstractmethod
    def event(self, data: dict[str, Any]) -> Event:
        """One stream event's JSON data, read."""


def read_usage(usage: Any, in_chat_terms: Callable[[dict[str, Any]], Usage]) -> Usage:
    """An API's usage in chat's terms; nothing when the answer carries none."""
    return in_chat_terms(usage) if isinstance(usage, dict) else {}


def split_system(history: Sequence[Message]) -> tuple[str | None, list[Message]]:
    """The system prompt (the first message, when it is one) and the rest."""
    if history and history[0]["role"] == "system":
        return history[0]["content"], list(history[1:])
    return None, list(history)


class ChatShape(ApiShape):
    api = Api.CHAT
    path = "/v1/chat/completions"

    def body(self, model: str, history: Sequence[Message], max_tokens: int) -> dict[str, Any]:
        return {"model": model, "messages": list(history), "max_tokens": max_tokens, "ignore_eos": True}

    def streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "stream": True, "stream_options": {"include_usage": True}}

    def answer(self, payload: dict[str, Any]) -> tuple[str, Usage]:
        return payload["choices"][0]["message"]["content"] or "", payload.get("usage") or {}

    def event(self, data: dict[str, Any]) -> Event:
        texts = ((choice.get("delta") or {}).get("content") for choice in data.get("choices") or [])
        error = data.get("error")
        return Event("".join(text for text in texts if text), data.get("usage"), None if error is None else str(error))


class ResponsesShape(ApiShape):
    api = Api.RESPONSES
    path = "/v1/responses"
    PART_TYPES: ClassVar[dict[str, str]] = {"assistant": "output_text"}  # the others' parts are input_text
    # The stream's last event, which carries the whole response with its usage.
    ENDING_EVENTS: ClassVar[frozenset[str]] = frozenset({"response.completed", "response.incomplete"})

    def body(self, model: str, history: Sequence[Message], max_tokens: int) -> dict[str, Any]:
        system, messages = split_system(history)
        items = [
            {
                "type": "message",
                "role": message["role"],
                "content": [{"type": self.PART_TYPES.get(message["role"], "input_text"), "text": message["content"]}],
            }
            for message in messages
        ]
        body = {"model": model, "input": items, "max_output_tokens": max_tokens, "ignore_eos": True, "store": False}
        return body if system is None else {**body, "instructions": system}

    def answer(self, payload: dict[str, Any]) -> tuple[str, Usage]:
        parts = (
            part["text"]
            for item in payload["output"]
            if item.get("type") == "message"
            for part in item["content"]
            if part.get("type") == "output_text"
        )
        return "".join(parts), read_usage(payload.get("usage"), responses_usage)

    def event(self, data: dict[str, Any]) -> Event:
        kind = data.get("type")
        if kind == "response.output_text.delta":
            return Event(data.get("delta") or "")
        if kind in self.ENDING_EVENTS:
            return Event(usage=read_usage((data.get("response") or {}).get("usage"), responses_usage))
        if kind == "response.failed":
            return Event(error=str((data.get("response") or {}).get("error")))
        if kind == "error":
            return Event(error=str(data.get("message") or data))
        return Event()


class MessagesShape(ApiShape):
    api = Api.MESSAGES
    path = "/v1/messages"

    def body(self, model: str, history: Sequence[Message], max_tokens: int) -> dict[str, Any]:
        system, messages = split_system(history)
        body = {"model": model, "messages": messages, "max_tokens": max_tokens}
        return body if system is None else {**body, "system": system}

    def answer(self, payload: dict[str, Any]) -> tuple[str, Usage]:
        text = "".join(block["text"] for block in payload["content"] if block.get("type") == "text")
        return text, read_usage(payload.get("usage"), messages_usage)

    def event(self, data: dict[str, Any]) -> Event:
        kind = data.get("type")
        if kind == "message_start":
            return Event(usage=read_usage((data.get("message") or {}).get("usage"), messages_usage))
        if kind == "content_block_delta":
            return Event((data.get("delta") or {}).get("text") or "")
        if kind == "message_delta":
            return Event(usage=read_usage(data.get("usage"), messages_usage))
        if kind == "error":
            return Event(error=str(data.get("error") or data))
        return Event()


SHAPES: dict[Api, ApiShape] = {shape.api: shape for shape in (ChatShape(), ResponsesShape(), MessagesShape())}
