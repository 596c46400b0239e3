"""The gateway reads an answer for the scheduler: the tool it calls, and the prompt's uncached tokens."""

from __future__ import annotations

import pytest

from thunderctl.gateway.answers import uncached_prompt_tokens
from thunderctl.gateway.apis import CHAT
from thunderctl.gateway.apis.chat import OpenAIChunks


def response(message: dict) -> dict:
    return {"choices": [{"index": 0, "message": message}]}


def tool_in_response(body: dict) -> str | None:
    return CHAT.answered(body).tool


def test_an_openai_tool_call_names_the_tool() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
    assert tool_in_response(response({"role": "assistant", "content": None, "tool_calls": [call]})) == "run_tests"


@pytest.mark.parametrize(
    ("name", "arguments", "tool"),
    [
        ("bash", '{"command": "cd /repo && pytest -x tests/"}', "bash cd"),
        ("execute_bash", '{"command": "FOO=1 /usr/bin/python3 setup.py", "timeout": 30}', "execute_bash python3"),
        ("str_replace_editor", '{"command": "view", "path": "/repo/setup.py"}', "str_replace_editor view"),
        ("bash", '{"command": ""}', "bash"),
        ("bash", '{"command": "ls", ', "bash"),  # not JSON: the name alone
        ("run_tests", '{"paths": ["tests/"]}', "run_tests"),
    ],
)
def test_a_tool_call_that_carries_a_command_line_is_named_with_its_command_word(
    name: str, arguments: str, tool: str
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    assert tool_in_response(response({"role": "assistant", "content": None, "tool_calls": [call]})) == tool


@pytest.mark.parametrize(
    ("content", "tool"),
    [
        ("I will run the tests.\n```bash\npytest -x tests/\n```", "pytest"),
        ("```\nFOO=1 /usr/bin/python3 setup.py\n```", "python3"),
        ("```sh\n  cd repo && ls\n```", "cd"),
        ("No command in this answer.", None),
    ],
)
def test_the_command_word_of_a_bash_block_names_the_tool(content: str, tool: str | None) -> None:
    assert tool_in_response(response({"role": "assistant", "content": content})) == tool


def test_a_streamed_answer_gives_its_tool_and_time_to_first_token() -> None:
    answer = OpenAIChunks(sent_at=10.0)
    answer.chunk({"choices": [{"delta": {"role": "assistant"}}]}, now=10.5)  # no token yet
    for now, text in ((12.0, "```bash\ngr"), (12.1, "ep -rn foo .\n```")):
        answer.chunk({"choices": [{"delta": {"content": text}}]}, now=now)
    assert answer.ttft_s == pytest.approx(2.0)
    assert answer.answer().tool == "grep"


def test_uncached_tokens_leave_out_the_prefix_cache_hit() -> None:
    assert uncached_prompt_tokens({"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 640}}) == 360
    assert uncached_prompt_tokens({"prompt_tokens": 1000}) == 1000  # the engine does not say
