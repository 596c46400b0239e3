"""What the simulated engine's generation APIs share: `Api` (how a route reads a request and sends
its answer), `Asked`, the tool-call rule, the answer's text as it streams, and vLLM 0.32's errors
(read from `vllm/entrypoints/serve/`, `vllm/renderers/params.py` for the length errors). Each API's
shapes are in its own module: `completions.py` (chat and completions), `responses.py` (the
Responses API), `messages.py` (the Anthropic Messages API).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from starlette.responses import JSONResponse, Response

from thunderctl.engines.simulated.runner import Generation

# vLLM's error type for a body its request model refuses (FastAPI validates it before any route runs).
VALIDATION = "Bad Request"


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


def invalid_body(param: str, problem: str) -> VllmError:
    """A body vLLM's request model refuses: `param` is where (`body.max_tokens`), `problem` what is wrong."""
    return VllmError(f"1 validation error:\n  {param}: {problem}", kind=VALIDATION, param=param)


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


def called_tool(names: list[str], named: str | None, refused: bool) -> str | None:
    """The function an answer calls when the request offers tools (`names`), in every API: the one
    tool_choice names, else the first, unless tool_choice refuses tools ("none")."""
    if not names or refused:
        return None
    return named or names[0]


@dataclass(frozen=True)
class Asked:
    """What a request asks of the engine, whichever API it came through."""

    body: dict[str, Any]
    model: str | None  # the model it names, if any
    prompt: list[int]
    max_tokens: Any  # the answer's length as the client sent it (None: the API's default), checked later
    stream: bool
    tool: str | None  # the function its answer calls


class Reply(Protocol):
    """One answer in its API's shape."""

    def whole(self, generation: Generation) -> dict[str, Any]: ...

    def stream(self, generation: Generation) -> AsyncIterator[bytes]: ...


class Api(ABC):
    """One of vLLM's generation routes: what a request asks, and how its answer and errors are sent."""

    default_tokens: int  # an answer's length when the request gives none
    length_param: ClassVar[str] = "max_tokens"

    @abstractmethod
    def read(self, body: dict[str, Any]) -> Asked:
        """The request, or a VllmError saying what is wrong with it."""

    @abstractmethod
    def reply(self, asked: Asked, model: str, max_tokens: int) -> Reply: ...

    def refuse(self, error: VllmError) -> Response:
        return error.response()

    def no_room(self, prompt_tokens: int, max_model_len: int, length: int) -> VllmError:
        """The error for a prompt that fits max_model_len but leaves no room for an answer."""
        return no_room_to_answer(length)


async def answer_texts(generation: Generation, tool: bool) -> AsyncIterator[tuple[str, bool]]:
    """The answer's text as the engine's steps sample it, each piece with whether it ends the answer:
    words joined by spaces, or (a tool call) the arguments' JSON those words are the one string of."""
    first, opened = True, False
    async for words, final in generation.pieces():
        text = " ".join(words)
        text = text if first or not words else f" {text}"
        if tool:  # '{"input": "' before, '"}' after
            text = ("" if opened else TOOL_ARGUMENTS_OPEN) + text + (TOOL_ARGUMENTS_CLOSE if final else "")
        yield text, final
        first, opened = first and not words, True


def sse_event(event: dict[str, Any]) -> bytes:
    """A typed SSE event, framed as vLLM's Responses and Anthropic routes send them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
