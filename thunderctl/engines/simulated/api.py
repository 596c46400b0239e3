"""vLLM 0.32's OpenAI response shapes, as the simulated engine sends them: whole answers, stream
chunks, the final usage chunk, and errors (read from `vllm/entrypoints/openai/*/protocol.py` and
`serving.py`, `vllm/renderers/params.py` for the length errors)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from starlette.responses import JSONResponse

# Every answer is exactly max_tokens long (there is no EOS to stop at): vLLM's reason for that.
FINISH_REASON = "length"
DONE_LINE = b"data: [DONE]\n\n"


class VllmError(Exception):
    """A request vLLM would refuse, with vLLM's status, error type, message and parameter."""

    def __init__(
        self, message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self) -> JSONResponse:
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}
        return JSONResponse({"error": error}, self.status)


def unknown_model(asked: str, served: str) -> VllmError:
    return VllmError(f"The model `{asked}` does not exist. Valid aliases: {served}.", 404, "NotFoundError", "model")


def prompt_too_long(prompt_tokens: int, max_model_len: int) -> VllmError:
    return VllmError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt.",
        param="input_tokens",
    )


def no_room_to_answer(max_tokens: int) -> VllmError:
    return VllmError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")


TOOL_ARGUMENTS_OPEN, TOOL_ARGUMENTS_CLOSE = '{"input": "', '"}'


def tool_arguments(text: str) -> str:
    """The arguments of a simulated tool call: the answer's words (letters and spaces, no escapes)."""
    return TOOL_ARGUMENTS_OPEN + text + TOOL_ARGUMENTS_CLOSE


def called_tool(body: dict[str, Any]) -> str | None:
    """The function a chat request's answer calls: the one `tool_choice` names, else the first of
    `tools` unless tool_choice is "none"."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    first = tools[0] if isinstance(tools[0], dict) else {}
    return (first.get("function") or {}).get("name")


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

    def whole(self, text: str) -> dict[str, Any]:
        """The non-streamed response."""
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

    async def stream(self, pieces: AsyncIterator[tuple[list[str], bool]], include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE stream: (for chat) the role, then the answer as it is sampled, the usage, [DONE]."""
        if self.kind is Kind.CHAT:
            yield self._chunk(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
        first, opened = True, False
        async for words, final in pieces:
            text = " ".join(words)
            text = text if first or not words else f" {text}"
            if self.tool:  # the words are the arguments' one string: '{"input": "' before, '"}' after
                text = ("" if opened else TOOL_ARGUMENTS_OPEN) + text + (TOOL_ARGUMENTS_CLOSE if final else "")
            yield self._chunk([self._delta(text, final, not opened)])
            first, opened = first and not words, True
        if include_usage:
            yield self._chunk([], usage=self.usage())
        yield DONE_LINE
