"""OpenAI chat completions (`/v1/chat/completions`): the API most harnesses and SDKs speak."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from thunderctl.gateway.apis.base import Answer, Api, StreamedAnswer
from thunderctl.gateway.identity import Turn


class _StreamOptions(BaseModel):
    include_usage: StrictBool | None = Field(None, description="true or false")


_Count = Annotated[StrictInt, Field(ge=1)]


class GenerationFields(BaseModel):
    """The fields of a chat or completion request the gateway itself acts on, with the types OpenAI
    documents; the rest is the engine's to judge. Only a check: the body goes on as the client sent it."""

    stream: StrictBool | None = Field(None, description="true or false")
    stream_options: _StreamOptions | None = Field(None, description="an object or null")
    max_tokens: _Count | None = Field(None, description="a positive integer or null")
    max_completion_tokens: _Count | None = Field(None, description="a positive integer or null")
    # Absent is a completion request; present, even null, must be a list.
    messages: list[Any] = Field(None, min_length=1, description="a non-empty list of {role, content} objects")
    prompt: str | list[StrictStr] | list[StrictInt] = Field(
        "", description="a string, a list of strings or a list of token ids"
    )


class OpenAIChunks(StreamedAnswer):
    """A chat or completions stream's chunks: the text, tool calls and token ids of the first choice
    (the one a client continues)."""

    def __init__(self, sent_at: float) -> None:
        super().__init__(sent_at)
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # by the delta's index
        self._token_ids: list[int] = []

    def chunk(self, chunk: dict[str, Any], now: float) -> None:
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")  # chat, completions
            if self.first_token_at is None and (text or delta.get("tool_calls")):
                self.first_token_at = now
            if isinstance(text, str):
                self._text.append(text)
            if isinstance(choice.get("token_ids"), list):
                self._token_ids.extend(choice["token_ids"])
            for call in delta.get("tool_calls") or []:
                self._call_delta(call)

    def _call_delta(self, call: dict[str, Any]) -> None:
        whole = self._calls.setdefault(call.get("index", len(self._calls)), {"name": None, "arguments": []})
        function = call.get("function") or {}
        whole["name"] = whole["name"] or function.get("name")
        if isinstance(function.get("arguments"), str):
            whole["arguments"].append(function["arguments"])

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def message(self) -> dict[str, Any]:
        """The answer as the assistant message a client echoes back."""
        calls = [
            {"function": {"name": call["name"], "arguments": "".join(call["arguments"])}}
            for _, call in sorted(self._calls.items())
        ]
        return {"role": "assistant", "content": self.text, "tool_calls": calls}

    def answer(self) -> Answer:
        return Answer(None, self.message, self.text, self._token_ids or None)


def first_choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices") or []
    return choices[0] if choices and isinstance(choices[0], dict) else {}


class ChatApi(Api):
    name = "chat"
    asks_usage = True
    fields = GenerationFields

    def turn(self, body: dict[str, Any]) -> Turn:
        return Turn(messages=body["messages"])

    def answered(self, body: dict[str, Any]) -> Answer:
        message = first_choice(body).get("message")
        return Answer(body.get("usage"), message if isinstance(message, dict) else None)

    def streamed(self, sent_at: float) -> StreamedAnswer:
        return OpenAIChunks(sent_at)
