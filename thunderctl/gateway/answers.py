"""What passes between the gateway and an engine for the scheduler: an answer's tool and prefill rate, a resumed request's priority."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# A command line's first word, past variable assignments (`FOO=1 python3 …`).
COMMAND_WORD = r"\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*([\w./-]+)"
# The first command word of a fenced shell block, as mini-swe-agent style agents answer.
BASH_COMMAND = re.compile(r"```(?:bash|sh|shell)?\s*\n" + COMMAND_WORD)
COMMAND_LINE = re.compile(COMMAND_WORD)
# The arguments that carry a shell tool's command line (mini-swe-agent's and SWE-agent's `bash`,
# OpenHands' `execute_bash`), or an editor tool's subcommand (`str_replace_editor`'s `view`).
COMMAND_ARGUMENTS = ("command", "cmd")


def tool_in_text(text: str) -> str | None:
    return command_word(BASH_COMMAND.search(text))


def command_word(match: re.Match[str] | None) -> str | None:
    return match.group(1).rsplit("/", 1)[-1] if match else None


def tool_in_message(message: dict[str, Any]) -> str | None:
    """An OpenAI tool call's function name, with its command's first word when its arguments
    carry a command line (`bash pytest`); else the command word of a bash block.

    Harnesses that call tools give most calls to one shell tool: named alone, every tool time
    would be of one kind, and a slow command could not be waited for by its own gaps."""
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name = function.get("name")
        if isinstance(name, str) and name:
            word = command_word_in_arguments(function.get("arguments"))
            return f"{name} {word}" if word else name
    content = message.get("content")
    return tool_in_text(content) if isinstance(content, str) else None


def command_word_in_arguments(arguments: Any) -> str | None:
    """The first word of the command line a tool call's JSON arguments carry, if any."""
    if not isinstance(arguments, str) or not any(f'"{key}"' in arguments for key in COMMAND_ARGUMENTS):
        return None  # most arguments carry none: no parse
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    line = next((parsed[key] for key in COMMAND_ARGUMENTS if isinstance(parsed.get(key), str)), None)
    return command_word(COMMAND_LINE.match(line)) if line else None


def tool_in_response(body: dict[str, Any]) -> str | None:
    choices = body.get("choices") or []
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    return tool_in_message(message) if isinstance(message, dict) else None


@dataclass
class StreamedAnswer:
    """A streamed answer as its chunks pass: its text, tool calls and token ids (of its first choice,
    the one a client continues), its first token's time."""

    sent_at: float
    first_token_at: float | None = None
    _text: list[str] = field(default_factory=list)
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by the delta's index
    _token_ids: list[int] = field(default_factory=list)

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
    def token_ids(self) -> list[int] | None:
        return self._token_ids or None

    @property
    def message(self) -> dict[str, Any]:
        """The answer as the assistant message a client echoes back."""
        calls = [
            {"function": {"name": call["name"], "arguments": "".join(call["arguments"])}}
            for _, call in sorted(self._calls.items())
        ]
        return {"role": "assistant", "content": self.text, "tool_calls": calls}

    @property
    def tool(self) -> str | None:
        return tool_in_message(self.message)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


def uncached_prompt_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens the engine computed: all of them, less its prefix cache's hit when it says."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return max(int(usage.get("prompt_tokens") or 0) - int(cached), 0)


# vLLM serves lower `priority` values first under --scheduling-policy priority; 0 is the default.
RESUMED_PRIORITY = -1


def resume_priority(engine_args: list[str]) -> int | None:
    """The priority a resumed program's request gets: only when the workers schedule by priority
    (otherwise vLLM refuses a request that carries one)."""
    for i, arg in enumerate(engine_args):
        value = arg.partition("=")[2] if arg.startswith("--scheduling-policy=") else None
        if arg == "--scheduling-policy" and i + 1 < len(engine_args):
            value = engine_args[i + 1]
        if value == "priority":
            return RESUMED_PRIORITY
    return None
