"""vLLM 0.32's chat and completion shapes, as the simulated engine sends them: whole answers, stream
chunks, the final usage chunk (read from `vllm/entrypoints/openai/{chat_completion,completion}/`
`protocol.py` and `serving.py`)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from thunderctl.engines.simulated.api import (
    Api,
    Asked,
    Reply,
    VllmError,
    answer_texts,
    called_tool,
    tool_arguments,
)
from thunderctl.engines.simulated.runner import Generation
from thunderctl.engines.simulated.tokens import render_chat, token_ids

# Every answer is exactly max_tokens long (there is no EOS to stop at): vLLM's reason for that.
FINISH_REASON = "length"
DONE_LINE = b"data: [DONE]\n\n"
# vLLM's default for /v1/completions; a chat without max_tokens would run to its end-of-sequence
# token, which the model has not got, so it gets as many tokens as an agent's turn often has.
DEFAULT_TEXT_ANSWER_TOKENS = 16
DEFAULT_CHAT_ANSWER_TOKENS = 256


class Kind(StrEnum):
    CHAT = "chat"
    TEXT = "text"


@dataclass
class Answer:
    """What one response says about its request, whichever way it is sent."""

    kind: Kind
    model: str
    prompt_tokens: int
    completion_tokens: int
    tool: str | None = None  # the function it calls (the request offered tools): its words are the arguments
    include_usage: bool = False  # a stream ends with the usage chunk
    id: str = field(default_factory=lambda: secrets.token_hex(16))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return f"{'chatcmpl' if self.kind is Kind.CHAT else 'cmpl'}-{self.id}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind is Kind.CHAT else "text_completion"

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }

    def whole(self, generation: Generation) -> dict[str, Any]:
        """The non-streamed response."""
        text = generation.text
        if self.kind is Kind.CHAT:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None if self.tool else text,
                    "tool_calls": [self._call(tool_arguments(text))] if self.tool else [],
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "tool_calls" if self.tool else FINISH_REASON,
                "stop_reason": None,
                "token_ids": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": FINISH_REASON,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
            }
        return {
            "id": self.response_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {**self.usage(), "prompt_tokens_details": None},
            "kv_transfer_params": None,
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": self.response_id,
            "object": f"{self.object}.chunk" if self.kind is Kind.CHAT else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()

    def _call(self, arguments: str, first: bool = True) -> dict[str, Any]:
        """A tool call, or (not `first`) a stream's later piece of its arguments."""
        if not first:
            return {"index": 0, "function": {"arguments": arguments}}
        return {"index": 0, "id": f"chatcmpl-tool-{self.id}", "type": "function",
                "function": {"name": self.tool, "arguments": arguments}}  # fmt: skip

    def _delta(self, text: str, final: bool, first: bool = False) -> dict[str, Any]:
        if self.kind is Kind.CHAT:
            delta = {"tool_calls": [self._call(text, first)]} if self.tool else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
            return (
                {**choice, "finish_reason": "tool_calls" if self.tool else FINISH_REASON, "stop_reason": None}
                if final
                else {**choice, "finish_reason": None}
            )
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": FINISH_REASON if final else None,
            "stop_reason": None,
        }

    async def stream(self, generation: Generation) -> AsyncIterator[bytes]:
        """The SSE stream: (for chat) the role, then the answer as it is sampled, the usage, [DONE]."""
        if self.kind is Kind.CHAT:
            yield self._chunk(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
        opened = False
        async for text, final in answer_texts(generation, bool(self.tool)):
            yield self._chunk([self._delta(text, final, not opened)])
            opened = True
        if self.include_usage:
            yield self._chunk([], usage=self.usage())
        yield DONE_LINE


def text_prompt(body: dict[str, Any]) -> list[int]:
    """A completion's prompt: text, or token ids, alone or as a batch of one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return token_ids(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise VllmError(
        "prompt must be a string or a list of token ids (the simulated engine answers one prompt per request)",
        param="prompt",
    )


def chat_prompt(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise VllmError("messages must be a list of {role, content} objects", param="messages")
    return token_ids(render_chat(messages))


def chat_tool(body: dict[str, Any]) -> str | None:
    """The function a chat's answer calls (tools as `{type, function: {name}}`)."""
    tools = body.get("tools")
    tools = tools if isinstance(tools, list) else []
    names = [(t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)]
    choice = body.get("tool_choice")
    named = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    return called_tool([n for n in names if isinstance(n, str)], named, choice == "none")


class CompletionsApi(Api):
    """`/v1/chat/completions` (`Kind.CHAT`) and `/v1/completions` (`Kind.TEXT`)."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.default_tokens = DEFAULT_CHAT_ANSWER_TOKENS if kind is Kind.CHAT else DEFAULT_TEXT_ANSWER_TOKENS

    def read(self, body: dict[str, Any]) -> Asked:
        if body.get("n", 1) not in (1, None):
            raise VllmError("the simulated engine answers with n=1 only", param="n")
        chat = self.kind is Kind.CHAT
        asked = body.get("max_completion_tokens") if chat else None
        return Asked(
            body,
            body.get("model"),
            chat_prompt(body) if chat else text_prompt(body),
            asked if asked is not None else body.get("max_tokens"),
            bool(body.get("stream")),
            chat_tool(body) if chat else None,
        )

    def reply(self, asked: Asked, model: str, max_tokens: int) -> Reply:
        include_usage = bool((asked.body.get("stream_options") or {}).get("include_usage"))
        return Answer(self.kind, model, len(asked.prompt), max_tokens, asked.tool, include_usage)
