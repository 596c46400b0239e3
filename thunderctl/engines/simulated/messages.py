"""vLLM 0.32's Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as the
simulated engine serves it (read from `vllm/entrypoints/anthropic/`): vLLM turns the request into a
chat completion and the chat's answer back into a message, so the prompt is the chat the request
converts to, the message's id is the chat's (`chatcmpl-...`), and its usage has no cache fields
(vLLM adds them only with `--enable-prompt-tokens-details`).

Errors the serving code returns come in Anthropic's shape (`{"type": "error", "error": {type,
message}}`); a body the request model refuses gets vLLM's usual validation error, as from FastAPI.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from thunderctl.engines.simulated.api import (
    VALIDATION,
    Api,
    Asked,
    Reply,
    VllmError,
    answer_texts,
    called_tool,
    invalid_body,
    sse_event,
    tool_arguments,
)
from thunderctl.engines.simulated.runner import Generation
from thunderctl.engines.simulated.tokens import render_chat, token_ids

BLOCK_TYPES = frozenset(
    {"text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
     "tool_addition", "tool_removal"}
)  # fmt: skip
CHOICE_TYPES = ("auto", "any", "tool", "none")
# Claude Code's attribution header: a per-request hash vLLM drops from the system prompt.
BILLING_HEADER = "x-anthropic-billing-header"


def blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content blocks, each of a type the request model knows."""
    if not isinstance(content, list) or not all(isinstance(b, dict) and b.get("type") in BLOCK_TYPES for b in content):
        raise invalid_body(
            where, f"Input should be a string or a list of content blocks of types {sorted(BLOCK_TYPES)}"
        )
    return content


def system_text(content: Any) -> str:
    """System text as vLLM joins it: the text blocks, without the billing header, with no separator."""
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    texts = (b.get("text") for b in content if b.get("type") == "text")
    return "".join(t for t in texts if t and not t.startswith(BILLING_HEADER))


def tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(
            item.get("text", "") for item in content if isinstance(item, dict) and item.get("type") == "text"
        )
    return content if isinstance(content, str) else ""


def chat_message(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as the chat messages vLLM converts it to: a user's tool results become
    tool messages ahead of it, tool_use blocks the assistant's tool calls, thinking its reasoning."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant", "system"):
        raise invalid_body(f"{where}.role", "Input should be 'user', 'assistant' or 'system'")
    if isinstance(content, str):
        return [{"role": role, "content": system_text(content) if role == "system" else content}]
    if role == "system":
        text = system_text(blocks(content, f"{where}.content"))
        return [{"role": "system", "content": text}] if text else []
    before: list[dict[str, Any]] = []
    converted: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    for block in blocks(content, f"{where}.content"):
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": ""}})  # an image has no text tokens here
        elif kind == "thinking" and block.get("thinking") is not None:
            converted["reasoning"] = converted.get("reasoning", "") + block["thinking"]
        elif kind == "tool_use":
            call = {"id": block.get("id"), "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}}  # fmt: skip
            converted.setdefault("tool_calls", []).append(call)
        elif kind == "tool_result" and role == "user":
            result = tool_result_text(block.get("content"))
            before.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": result})
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    keep = role != "user" or "content" in converted  # a user message of tool results alone is not kept
    return [*before, *([converted] if keep else [])]


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request as the chat vLLM renders: the system prompt first, then each message's conversion."""
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        system = system_text(blocks(system, "body.system"))
    if system:
        chat.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid_body("body.messages", "Field required: a list of {role, content} messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid_body(f"body.messages.{index}", "Input should be a message object {role, content}")
        chat += chat_message(message, f"body.messages.{index}")
    return chat


def anthropic_prompt(body: dict[str, Any]) -> list[int]:
    if not body.get("model"):
        raise invalid_body("body.model", "Field required")
    return token_ids(render_chat(anthropic_messages(body)))


def token_count(tokens: int) -> dict[str, Any]:
    """count_tokens' answer, as vLLM sends it."""
    return {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}


def anthropic_tool(body: dict[str, Any]) -> str | None:
    """The function the answer calls: tools as `{name, input_schema}`, tool_choice `{type, name}`."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("input_schema"), dict)
                                              for t in tools):  # fmt: skip
        raise invalid_body("body.tools", "Input should be a list of tools {name, description, input_schema}")
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in CHOICE_TYPES:
        raise invalid_body("body.tool_choice.type", f"Input should be one of {', '.join(CHOICE_TYPES)}")
    if choice["type"] == "tool" and not choice.get("name"):
        raise invalid_body("body.tool_choice", "Value error, tool_choice.name is required when type is 'tool'")
    names = [t.get("name") for t in tools]
    named = choice.get("name") if choice["type"] == "tool" else None
    return called_tool([n for n in names if isinstance(n, str)], named, choice["type"] == "none")


class MessagesApi(Api):
    """`POST /v1/messages` (with or without `?beta=true`)."""

    default_tokens = 0  # max_tokens is required

    def read(self, body: dict[str, Any]) -> Asked:
        prompt = anthropic_prompt(body)
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise invalid_body("body.max_tokens", "Field required")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise invalid_body("body.max_tokens", "Input should be a valid integer")
        if max_tokens <= 0:
            raise invalid_body("body.max_tokens", "Value error, max_tokens must be positive")
        return Asked(body, body["model"], prompt, max_tokens, bool(body.get("stream")), anthropic_tool(body))

    def reply(self, asked: Asked, model: str, max_tokens: int) -> Reply:
        return MessagesReply(asked, model)

    def refuse(self, error: VllmError) -> Response:
        if error.kind == VALIDATION:  # FastAPI's, before the route's own translation
            return error.response()
        return JSONResponse({"type": "error", "error": {"type": error.kind, "message": str(error)}}, error.status)


class MessagesReply:
    """One message: whole, or as Anthropic's stream of events."""

    def __init__(self, asked: Asked, model: str) -> None:
        self.model, self.tool = model, asked.tool
        self.id = secrets.token_hex(16)
        self.prompt_tokens = len(asked.prompt)

    @property
    def stop_reason(self) -> str:
        return "tool_use" if self.tool else "max_tokens"

    def usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}

    def block(self, text: str) -> dict[str, Any]:
        """The content block: the text, or the tool_use whose input the arguments are."""
        if self.tool:
            return {"type": "tool_use", "id": f"chatcmpl-tool-{self.id}", "name": self.tool, "input": json.loads(text)}
        return {"type": "text", "text": text}

    def whole(self, generation: Generation) -> dict[str, Any]:
        text = tool_arguments(generation.text) if self.tool else generation.text
        return {
            "id": f"chatcmpl-{self.id}",
            "type": "message",
            "role": "assistant",
            "content": [self.block(text)],
            "model": self.model,
            "stop_reason": self.stop_reason,  # stop_sequence is null, which vLLM leaves out here
            "usage": self.usage(generation.completion_tokens),
        }

    async def stream(self, generation: Generation) -> AsyncIterator[bytes]:
        """message_start (with the prompt's usage), the block's start, deltas and stop,
        message_delta (stop_reason, usage), message_stop."""
        message: dict[str, Any] = {"id": f"chatcmpl-{self.id}", "type": "message", "role": "assistant", "content": [],
                   "model": self.model, "stop_reason": None, "stop_sequence": None, "usage": self.usage(0)}  # fmt: skip
        yield sse_event({"type": "message_start", "message": message})
        started = False
        async for text, _ in answer_texts(generation, bool(self.tool)):
            if not text:
                continue  # vLLM sends no event for an empty piece
            if not started:
                start = self.block("{}") if self.tool else self.block("")
                yield sse_event({"type": "content_block_start", "content_block": start, "index": 0})
                started = True
            delta = (
                {"type": "input_json_delta", "partial_json": text}
                if self.tool
                else {"type": "text_delta", "text": text}
            )
            yield sse_event({"type": "content_block_delta", "delta": delta, "index": 0})
        if started:
            yield sse_event({"type": "content_block_stop", "index": 0})
        stop = {"stop_reason": self.stop_reason, "stop_sequence": None}
        yield sse_event({"type": "message_delta", "delta": stop, "usage": self.usage(generation.completion_tokens)})
        yield sse_event({"type": "message_stop"})
