"""Each API the gateway schedules, read as the scheduler and identity need it (thunderctl/gateway/apis/):
a conversation continued through the Responses or Messages API finds its program as chat's does, and
an answer's usage and tool come out in chat's terms, whole or streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from thunderctl.gateway.apis import GENERATE, MESSAGES, RESPONSES, Api
from thunderctl.gateway.identity import ConversationIndex
from thunderctl.jsonapi import BadRequest

RESPONSE_OUTPUT = [
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
     "arguments": '{"command": ["bash", "-lc", "ls"]}', "status": "completed"},
]  # fmt: skip
RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": RESPONSE_OUTPUT,
    "usage": {
        "input_tokens": 120,
        "output_tokens": 30,
        "total_tokens": 150,
        "input_tokens_details": {"cached_tokens": 64},
    },
}
MESSAGE_CONTENT = [
    {"type": "thinking", "thinking": "read first", "signature": "sig"},
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls -la"}},
]
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "content": MESSAGE_CONTENT,
    "usage": {
        "input_tokens": 20,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 0,
        "output_tokens": 30,
    },
}


def responses_request(items: list[Any]) -> dict[str, Any]:
    return {"model": "tiny", "instructions": "You are Codex.", "input": items, "store": False, "stream": True}


def messages_request(messages: list[Any]) -> dict[str, Any]:
    return {"model": "tiny", "system": [{"type": "text", "text": "You are Claude Code."}], "messages": messages,
            "max_tokens": 64}  # fmt: skip


def claimed(index: ConversationIndex, api: Api, body: dict[str, Any], answer: dict[str, Any]) -> str:
    claim = index.follow(api.turn(body))
    assert claim is not None
    index.answered(claim, message=api.answered(answer).message or {})
    return claim.program_id


def test_a_responses_conversation_echoed_back_with_its_reasoning_and_calls_is_one_program() -> None:
    index = ConversationIndex(10)
    task = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
    first = claimed(index, RESPONSES, responses_request([task]), RESPONSE)
    # Codex sends the output items back (ids and encrypted reasoning as they came), then the call's output.
    echoed = [task, *RESPONSE_OUTPUT, {"type": "function_call_output", "call_id": "call_1", "output": "a.py"}]
    assert claimed(index, RESPONSES, responses_request(echoed), RESPONSE) == first


def test_a_messages_conversation_echoed_back_with_cache_control_moved_is_one_program() -> None:
    index = ConversationIndex(10)
    task = {
        "role": "user",
        "content": [{"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}],
    }
    first = claimed(index, MESSAGES, messages_request([task]), MESSAGE)
    echoed = [
        {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
        {"role": "assistant", "content": MESSAGE_CONTENT},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py",
                                      "cache_control": {"type": "ephemeral"}}]},
    ]  # fmt: skip
    assert claimed(index, MESSAGES, messages_request(echoed), MESSAGE) == first


def test_two_sessions_of_the_same_task_are_two_programs() -> None:
    index = ConversationIndex(10)
    task = {"role": "user", "content": "list the files"}
    assert claimed(index, MESSAGES, messages_request([task]), MESSAGE) != claimed(
        index, MESSAGES, messages_request([task]), MESSAGE
    )


def test_a_responses_answer_gives_usage_in_chat_terms_and_the_command_it_runs() -> None:
    answer = RESPONSES.answered(RESPONSE)
    assert answer.usage == {
        "prompt_tokens": 120,
        "completion_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert answer.tool == "shell ls"  # the line `bash -lc` runs


def test_a_messages_answer_counts_the_cached_prompt_in_its_prompt_tokens() -> None:
    answer = MESSAGES.answered(MESSAGE)
    assert answer.usage == {
        "prompt_tokens": 120,
        "completion_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 100},
    }
    assert answer.tool == "Bash ls"


def events(api: Api, chunks: list[dict[str, Any]]) -> tuple[Any, dict[str, Any] | None]:
    """Feed a stream's events to the API's reader, one a second; its answer and the usage they carried."""
    reader, usage = api.streamed(sent_at=0.0), None
    for now, chunk in enumerate(chunks, start=1):
        reader.chunk(chunk, float(now))
        if found := api.usage_of(chunk):
            usage = {**usage, **found} if usage else found
    return reader, usage


def test_a_responses_stream_gives_its_first_token_time_its_answer_and_usage() -> None:
    reader, usage = events(RESPONSES, [
        {"type": "response.created", "response": {"id": "resp_1", "output": [], "usage": None}},
        {"type": "response.output_item.added", "item": RESPONSE_OUTPUT[1] | {"content": []}},
        {"type": "response.output_text.delta", "delta": "Let me"},
        {"type": "response.output_text.delta", "delta": " look."},
        {"type": "response.function_call_arguments.delta", "delta": '{"command"'},
        {"type": "response.completed", "response": RESPONSE},
    ])  # fmt: skip
    assert reader.ttft_s == 3.0
    assert reader.answer() == RESPONSES.answered(RESPONSE) and usage == RESPONSES.answered(RESPONSE).usage


def test_a_messages_stream_gives_the_same_answer_as_the_whole_message() -> None:
    reader, usage = events(MESSAGES, [
        {"type": "message_start", "message": MESSAGE | {"content": [], "usage": {"input_tokens": 20,
         "cache_read_input_tokens": 100, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "read first"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Let me "}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "look."}},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1",
         "name": "Bash", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"comm'}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
         "partial_json": 'and": "ls -la"}'}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 30}},
        {"type": "message_stop"},
    ])  # fmt: skip
    whole = MESSAGES.answered(MESSAGE)
    assert reader.ttft_s == 3.0 and reader.answer().tool == whole.tool == "Bash ls"
    index = ConversationIndex(10)
    claim = index.follow(MESSAGES.turn(messages_request([{"role": "user", "content": "go"}])))
    assert claim is not None
    index.answered(claim, message=reader.answer().message or {})
    follow = messages_request([{"role": "user", "content": "go"}, {"role": "assistant", "content": MESSAGE_CONTENT}])
    assert index.follow(MESSAGES.turn(follow)).program_id == claim.program_id  # type: ignore[union-attr]
    assert usage == {"prompt_tokens": 120, "completion_tokens": 30, "prompt_tokens_details": {"cached_tokens": 100}}


@pytest.mark.parametrize(
    ("api", "body", "named"),
    [
        (RESPONSES, {"input": [], "stream": "yes"}, "stream must be true or false, not a string"),
        (RESPONSES, {"input": 3}, "input must be a string or a non-empty array of input items, not 3"),
        (RESPONSES, {"stream": True}, "input must be a string or a non-empty array of input items, not missing"),
        (RESPONSES, {"input": "hi", "previous_response_id": 7}, "previous_response_id must be a response id"),
        (MESSAGES, {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens must be a positive integer, not missing"),
        (MESSAGES, {"messages": [], "max_tokens": 5}, "messages must be a non-empty array"),
        (MESSAGES, {"messages": "hi", "max_tokens": 5}, "messages must be a non-empty array of {role, content} objects, not a string"),
    ],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_refused_naming_it(api: Api, body: dict[str, Any], named: str) -> None:
    with pytest.raises(BadRequest, match=named.replace("{", r"\{").replace("}", r"\}")):
        api.check(body)


def test_claude_codes_session_in_metadata_names_the_program_in_either_form() -> None:
    new = {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "9f1c"})}}
    old = {"metadata": {"user_id": "user_abc_account__session_77aa-01"}}
    assert MESSAGES.program_hints(new)[0][1] == "9f1c" and MESSAGES.program_hints(old)[0][1] == "77aa-01"
    assert MESSAGES.program_hints({"metadata": {"user_id": "someone"}})[0][1] is None


def test_token_in_generate_requests_continue_their_program_by_their_ids() -> None:
    index = ConversationIndex(10)
    first = index.follow(GENERATE.turn({"token_ids": [1, 2, 3]}))
    assert first is not None
    answer = GENERATE.answered({"choices": [{"index": 0, "token_ids": [7, 8]}], "usage": {"prompt_tokens": 3}})
    index.answered(first, text=answer.text or "", token_ids=answer.token_ids)
    follow = index.follow(GENERATE.turn({"token_ids": [1, 2, 3, 7, 8, 42]}))
    assert follow is not None and follow.program_id == first.program_id
