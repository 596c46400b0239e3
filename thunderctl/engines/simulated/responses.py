"""vLLM 0.32's OpenAI Responses API (`POST /v1/responses`), as the simulated engine serves it: the
request's input rendered as a chat, the response object, and its stream of typed SSE events (read
from `vllm/entrypoints/openai/responses/` — `protocol.py`, `serving.py`, `streaming_events.py`,
`utils.py` — and the `openai` types they dump).

vLLM without `VLLM_ENABLE_RESPONSES_API_STORE` stores nothing: it ignores `store: true`, answers a
`previous_response_id` with a 404 (no response was kept), and refuses `background`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

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
from thunderctl.engines.simulated.completions import DEFAULT_CHAT_ANSWER_TOKENS
from thunderctl.engines.simulated.runner import Generation
from thunderctl.engines.simulated.tokens import render_chat, token_ids

NO_STORE_BACKGROUND = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
    "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
    "launching the vLLM server."
)
# The fields of an `openai` FunctionTool, in its order: vLLM echoes each tool with all of them.
FUNCTION_TOOL_FIELDS = (
    "name", "parameters", "strict", "type", "allowed_callers", "async", "defer_loading", "description", "output_schema",
)  # fmt: skip


def hex_id() -> str:
    return secrets.token_hex(8)  # vLLM's random_uuid: 16 hex digits


def first_text(parts: Any) -> str | None:
    """The text of the first part, as vLLM takes an item's text (`content[0].text`)."""
    first = parts[0] if isinstance(parts, list) and parts else None
    return first.get("text") if isinstance(first, dict) else None


def item_message(item: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a chat message, or None when it joined `previous` (an assistant message:
    a function call, reasoning or text following it in the same turn), as vLLM's
    `construct_chat_messages_with_tool_call` does."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise VllmError("Encrypted content is not supported.", param="input")
        reasoning = first_text(item.get("content") or item.get("summary"))
        if assistant is not None and "reasoning" not in assistant:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else first_text(content) if content else None
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if "role" in item:
        return item
    raise VllmError(f"Unsupported input item type: {kind}", param="input")


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request as the chat vLLM renders: `instructions` as the system message, then `input`
    (a string is the user's message; items become messages, a turn's items one assistant message)."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not all(isinstance(item, dict) for item in given):
        raise invalid_body("body.input", "Input should be a valid string or a list of input items")
    for item in given:
        message = item_message(dict(item), messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def function_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise invalid_body("body.tools", "Input should be a valid list of tools")
    return [tool for tool in tools if tool.get("type") == "function"]


def tool_choice(body: dict[str, Any]) -> Any:
    """tool_choice as vLLM's request model leaves it: "none" when no tool is offered."""
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    tools = body.get("tools") or []
    if not tools:
        if choice == "required":
            raise VllmError("Tool choice 'required' must be specified with 'tools' parameter.", kind=VALIDATION,
                            param="tool_choice")  # fmt: skip
        if named:
            raise VllmError("Tool choice 'function' not found in 'tools' parameter.", kind=VALIDATION,
                            param="tool_choice")  # fmt: skip
        return "none"
    if named and choice.get("name") not in {tool.get("name") for tool in tools if isinstance(tool, dict)}:
        raise VllmError("Tool choice 'function' not found in 'tools' parameter.", kind=VALIDATION, param="tool_choice")
    return choice


class ResponsesApi(Api):
    """`POST /v1/responses`."""

    default_tokens = DEFAULT_CHAT_ANSWER_TOKENS  # vLLM would run to the end-of-sequence token, as a chat does
    length_param = "max_output_tokens"

    def read(self, body: dict[str, Any]) -> Asked:
        if "input" not in body:
            raise invalid_body("body.input", "Field required")
        if body.get("background"):
            if body.get("store") is False:
                raise VllmError("background can only be used when `store` is true", kind=VALIDATION,
                                param="background")  # fmt: skip
            raise VllmError(NO_STORE_BACKGROUND, kind="invalid_request_error", param="background")
        choice = tool_choice(body)
        if body.get("previous_response_id") is not None:  # nothing is stored, so no response is found
            raise VllmError(
                f"Response with id '{body['previous_response_id']}' not found.", 404, "invalid_request_error",
                "response_id",
            )  # fmt: skip
        names = [tool.get("name") for tool in function_tools(body)]
        named = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
        return Asked(
            {**body, "tool_choice": choice},
            body.get("model"),
            token_ids(render_chat(responses_messages(body))),
            body.get("max_output_tokens"),
            bool(body.get("stream")),
            called_tool([n for n in names if isinstance(n, str)], named, choice == "none"),
        )

    def reply(self, asked: Asked, model: str, max_tokens: int) -> Reply:
        return ResponsesReply(asked, model, max_tokens)

    def no_room(self, prompt_tokens: int, max_model_len: int, length: int) -> VllmError:
        if prompt_tokens < max_model_len:
            return super().no_room(prompt_tokens, max_model_len, length)
        return VllmError(
            f"The engine prompt length {prompt_tokens} exceeds the max_model_len {max_model_len}. Please reduce "
            "prompt.",
            kind="invalid_request_error",
            param="input",
        )


def echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the response echoes it: a function tool with every field of `openai`'s FunctionTool."""
    if tool.get("type") != "function":
        return tool
    return {name: tool.get(name) for name in FUNCTION_TOOL_FIELDS}


def numbered(event: dict[str, Any], number: int) -> dict[str, Any]:
    """The event with its sequence_number, just before its type as vLLM's events have it."""
    out: dict[str, Any] = {}
    for key, value in event.items():
        if key == "type":
            out["sequence_number"] = number
        out[key] = value
    return out


class ResponsesReply:
    """One response: the object (whole, or in the stream's first and last events) and the stream."""

    def __init__(self, asked: Asked, model: str, max_tokens: int) -> None:
        self.asked, self.model, self.max_tokens = asked, model, max_tokens
        self.id = f"resp_{hex_id()}"
        self.created_at = int(time.time())
        self.tool = asked.tool
        self.item_id = f"fc_{hex_id()}" if self.tool else f"msg_{hex_id()}"
        self.call_id = f"chatcmpl-tool-{hex_id()}"

    @property
    def status(self) -> str:
        """A text answer ran to max_output_tokens ("incomplete", as vLLM says when the length stops it);
        a tool call is a whole answer, as chat's finish_reason "tool_calls" says."""
        return "completed" if self.tool else "incomplete"

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object, in vLLM's field order (`ResponsesResponse.from_request`)."""
        body = self.asked.body
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
            "tool_choice": body["tool_choice"],
            "tools": [echoed_tool(tool) for tool in body.get("tools") or []],
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "background": False,
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": None,
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "presence_penalty": body.get("presence_penalty") or 0.0,
            "frequency_penalty": body.get("frequency_penalty") or 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    @staticmethod
    def usage(generation: Generation) -> dict[str, Any]:
        prompt, answer = generation.prompt_tokens, generation.completion_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": generation.cached_tokens,
                "cache_write_tokens": generation.cache_write_tokens,
                "input_tokens_per_turn": [],  # vLLM counts turns only for its built-in tools' loops
                "cached_tokens_per_turn": [],
            },
            "output_tokens": answer,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": prompt + answer,
        }

    def item(self, text: str, status: str) -> dict[str, Any]:
        """The output item: the function call, or the assistant message with its output_text."""
        if self.tool:
            return {"arguments": text, "call_id": self.call_id, "name": self.tool, "type": "function_call",
                    "id": self.item_id, "async": None, "caller": None, "namespace": None, "status": status}  # fmt: skip
        done = status == "completed"
        return {"id": self.item_id, "content": [text_part(text, None)] if done else [], "role": "assistant",
                "status": status, "type": "message", "phase": None}  # fmt: skip

    def whole(self, generation: Generation) -> dict[str, Any]:
        text = tool_arguments(generation.text) if self.tool else generation.text
        return self.response(self.status, [self.item(text, "completed")], self.usage(generation))

    async def stream(self, generation: Generation) -> AsyncIterator[bytes]:
        """vLLM's events in its order, numbered from 0: created, in_progress, the item added (and its
        text part), its deltas, its done events, completed with the whole response."""
        number = 0
        async for event in self._events(generation):
            yield sse_event(numbered(event, number))
            number += 1

    async def _events(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        started = self.response("in_progress", [], None)
        yield {"response": started, "type": "response.created"}
        yield {"response": started, "type": "response.in_progress"}
        at = {"item_id": self.item_id, "output_index": 0}
        yield {"item": self.item("", "in_progress"), "output_index": 0, "type": "response.output_item.added"}
        if not self.tool:
            yield {"content_index": 0, **at, "part": text_part("", []), "type": "response.content_part.added"}
        sent = ""
        async for text, _ in answer_texts(generation, bool(self.tool)):
            if not text:
                continue  # vLLM sends no event for a step without text
            sent += text
            if self.tool:
                yield {"delta": text, **at, "type": "response.function_call_arguments.delta"}
            else:
                yield {"content_index": 0, "delta": text, "item_id": self.item_id, "logprobs": [], "output_index": 0,
                       "type": "response.output_text.delta"}  # fmt: skip
        if self.tool:
            yield {"arguments": sent, **at, "type": "response.function_call_arguments.done", "name": self.tool}
        else:
            yield {"content_index": 0, "item_id": self.item_id, "logprobs": [], "output_index": 0, "text": sent,
                   "type": "response.output_text.done"}  # fmt: skip
            yield {"content_index": 0, **at, "part": text_part(sent, None), "type": "response.content_part.done"}
        item = self.item(sent, "completed")
        yield {"item": item, "output_index": 0, "type": "response.output_item.done"}
        yield {"response": self.response(self.status, [item], self.usage(generation)), "type": "response.completed"}


def text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    """An output_text part: `logprobs` is [] while it streams and null once done, as vLLM sends it."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}
