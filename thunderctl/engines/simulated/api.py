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
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": FINISH_REASON,
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

    def _delta(self, text: str, final: bool) -> dict[str, Any]:
        if self.kind is Kind.CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
            return (
                {**choice, "finish_reason": FINISH_REASON, "stop_reason": None}
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
        first = True
        async for words, final in pieces:
            text = " ".join(words)
            yield self._chunk([self._delta(text if first or not words else f" {text}", final)])
            first = first and not words
        if include_usage:
            yield self._chunk([], usage=self.usage())
        yield DONE_LINE
