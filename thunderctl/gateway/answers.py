"""What passes between the gateway and an engine for the scheduler: an answer's tool and prefill rate, a resumed request's priority."""

from __future__ import annotations

import json
import re
from typing import Any

# A command line's first word, past variable assignments (`FOO=1 python3 …`).
COMMAND_WORD = r"\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*([\w./-]+)"
# The first command word of a fenced shell block, as mini-swe-agent style agents answer.
BASH_COMMAND = re.compile(r"```(?:bash|sh|shell)?\s*\n" + COMMAND_WORD)
COMMAND_LINE = re.compile(COMMAND_WORD)
# The arguments that carry a shell tool's command line (mini-swe-agent's and SWE-agent's `bash`,
# OpenHands' `execute_bash`), or an editor tool's subcommand (`str_replace_editor`'s `view`).
COMMAND_ARGUMENTS = ("command", "cmd")
SHELL_FLAGS = ("-c", "-lc")  # `bash -lc LINE`: the line is the command


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
    """The first word of the command line a tool call's arguments carry (JSON text, or an object as
    Anthropic's `tool_use` input is), if any."""
    if isinstance(arguments, dict):
        parsed = arguments
    elif not isinstance(arguments, str) or not any(f'"{key}"' in arguments for key in COMMAND_ARGUMENTS):
        return None  # most arguments carry none: no parse
    else:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(parsed, dict):
        return None
    line = next((command_line(parsed[key]) for key in COMMAND_ARGUMENTS if key in parsed), None)
    return command_word(COMMAND_LINE.match(line)) if line else None


def command_line(command: Any) -> str | None:
    """A command as text: itself, or an argv (Codex CLI's `shell` tool sends `["bash", "-lc", "…"]`: the
    line the shell runs)."""
    if isinstance(command, str):
        return command
    if not isinstance(command, list) or not command or not all(isinstance(arg, str) for arg in command):
        return None
    if len(command) == 3 and command[1] in SHELL_FLAGS:
        return command[2]
    return " ".join(command)


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
