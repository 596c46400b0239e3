"""`bench swe-lite --api`: each API's request carries chat's history and lengths, its answers are read
whole and streamed, and a run over the simulated engine replays the same steps through each."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from thunderctl.bench.apis import SHAPES, Api
from thunderctl.bench.cli import bench_app
from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.planning import plan_program, system_prompt
from thunderctl.bench.requests import Reply, take_event
from thunderctl.bench.swe_lite import SweLite
from thunderctl.gateway.apis import GENERATION_ROUTES
from thunderctl.gateway.requests import text_of

TURN = 5


def history_at_turn(turn: int) -> tuple[list[dict[str, str]], int]:
    """A swe-lite program's history as the closed loop sends it at `turn`, and that step's answer length."""
    workload = SweLite(scale=0.1)
    plan = plan_program(
        workload, seed=0, salt="s", index=3, tokens_per_word=1.0, system_text=system_prompt(workload, 0, "s", 1.0)
    )
    messages = list(plan.messages)
    for step in plan.steps[:turn]:
        answer = " ".join(["word"] * step.completion_tokens)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": step.observation}]
    return messages, plan.steps[turn].completion_tokens


def as_chat(api: Api, body: dict) -> list[tuple[str, str]]:
    """The request's conversation as (role, text), read by the gateway's own module for its API."""
    turn = GENERATION_ROUTES[SHAPES[api].path].turn(body)
    assert turn.messages is not None
    return [(m["role"], text_of(m["content"])) for m in turn.messages]


@pytest.mark.parametrize("api", [Api.RESPONSES, Api.MESSAGES])
def test_turn_n_of_every_api_carries_chats_history_and_length(api: Api) -> None:
    history, length = history_at_turn(TURN)
    chat = SHAPES[Api.CHAT].body("tiny", history, length)
    body = SHAPES[api].body("tiny", history, length)

    assert as_chat(api, body) == as_chat(Api.CHAT, chat) == [(m["role"], m["content"]) for m in history]
    # The system prompt goes in its own field: every other message is one item or message.
    listed = body["input"] if api is Api.RESPONSES else body["messages"]
    assert len(listed) == len(chat["messages"]) - 1 == 1 + 2 * TURN  # the task, then TURN answers and observations
    words = [len(text.split()) for _, text in as_chat(api, body)]
    assert words == [len(m["content"].split()) for m in chat["messages"]]
    asked = body["max_output_tokens"] if api is Api.RESPONSES else body["max_tokens"]
    assert asked == chat["max_tokens"] == length


def test_the_responses_request_is_codexs_shape_with_the_length_forced() -> None:
    history, length = history_at_turn(1)
    body = SHAPES[Api.RESPONSES].body("tiny", history, length)
    assert body["instructions"] == history[0]["content"] and body["store"] is False and body["ignore_eos"] is True
    answer = body["input"][1]
    assert answer == {"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": history[2]["content"]}]}  # fmt: skip
    assert body["input"][0]["content"][0]["type"] == "input_text"
    assert SHAPES[Api.RESPONSES].streamed(body)["stream"] is True


def test_the_messages_request_cannot_force_the_length() -> None:
    history, length = history_at_turn(1)
    body = SHAPES[Api.MESSAGES].body("tiny", history, length)
    assert body["system"] == history[0]["content"] and body["max_tokens"] == length
    assert "ignore_eos" not in body  # vLLM's Anthropic request has no such field


def streamed(api: Api, events: list[dict]) -> Reply:
    reply, parts = Reply(200), []
    for index, event in enumerate(events):
        take_event(SHAPES[api].event(event), reply, parts, 0.1 * index)
    reply.text = "".join(parts)
    return reply


def test_a_responses_stream_gives_its_text_first_token_and_completed_usage() -> None:
    reply = streamed(
        Api.RESPONSES,
        [
            {"type": "response.created", "response": {"usage": None}},
            {"type": "response.output_item.added", "item": {"type": "message"}},
            {"type": "response.output_text.delta", "delta": "fix the"},
            {"type": "response.output_text.delta", "delta": " file"},
            {"type": "response.output_text.done", "text": "fix the file"},
            {"type": "response.completed", "response": {"usage": {"input_tokens": 40, "output_tokens": 3}}},
        ],
    )
    assert (reply.text, reply.ttft_s, reply.prompt_tokens, reply.completion_tokens) == ("fix the file", 0.2, 40, 3)
    assert reply.error is None


def test_a_messages_stream_adds_the_cached_prompt_and_takes_the_last_output_count() -> None:
    reply = streamed(
        Api.MESSAGES,
        [
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 10, "cache_read_input_tokens": 30, "output_tokens": 0}},
            },  # fmt: skip
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "run"}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " it"}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}},
            {"type": "message_stop"},
        ],
    )
    assert (reply.text, reply.ttft_s, reply.prompt_tokens, reply.completion_tokens) == ("run it", 0.2, 40, 2)


@pytest.mark.parametrize(
    ("api", "event"),
    [(Api.RESPONSES, {"type": "error", "message": "engine died"}),
     (Api.MESSAGES, {"type": "error", "error": {"type": "api_error", "message": "engine died"}})],
)  # fmt: skip
def test_an_error_event_fails_the_step(api: Api, event: dict) -> None:
    assert "engine died" in (streamed(api, [event]).error or "")


def test_whole_answers_give_their_text_and_usage() -> None:
    response = {
        "output": [{"type": "reasoning", "content": []},
                   {"type": "message", "content": [{"type": "output_text", "text": "a b"}]}],
        "usage": {"input_tokens": 12, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 8}},
    }  # fmt: skip
    message = {"content": [{"type": "text", "text": "c d e"}], "usage": {"input_tokens": 7, "output_tokens": 3}}
    assert SHAPES[Api.RESPONSES].answer(response)[0] == "a b"
    assert SHAPES[Api.RESPONSES].answer(response)[1]["prompt_tokens"] == 12
    assert SHAPES[Api.MESSAGES].answer(message) == ("c d e", {"prompt_tokens": 7, "completion_tokens": 3,
                                                              "prompt_tokens_details": {"cached_tokens": 0}})  # fmt: skip


# --- over the simulated engine ---------------------------------------------------------


def steps_sent(url: str, api: Api, stream: bool) -> list[tuple[int, int, int | None, int | None]]:
    """(program, step, prompt tokens, answer tokens) of every step of a short run straight to `url`."""
    spec = LoadSpec(
        concurrency=2, shape=SweLite(scale=0.05), programs=3, seed=1, model="tiny", stream=stream, api=api,
        time_scale=0.0, salt="same", age_initial_programs=True,
    )  # fmt: skip
    result = asyncio.run(run_load(Target.direct([url]), spec, [url]))
    assert result.steps_failed == 0, {r.error for r in result.records}
    return sorted((r.program_index, r.step, r.prompt_tokens, r.completion_tokens) for r in result.records)


@pytest.mark.parametrize("api", [Api.RESPONSES, Api.MESSAGES])
@pytest.mark.slow
def test_every_api_sends_the_steps_chat_sends_token_for_token(start_sim, api: Api) -> None:
    sim = start_sim("--time-scale", "0")
    chat = steps_sent(sim.url, Api.CHAT, stream=True)
    assert chat and all(prompt and answer for _, _, prompt, answer in chat)
    assert steps_sent(sim.url, api, stream=True) == chat
    assert steps_sent(sim.url, api, stream=False) == chat


@pytest.mark.parametrize("api", [Api.RESPONSES, Api.MESSAGES])
@pytest.mark.slow
def test_a_comparison_over_an_api_serves_both_arms_and_names_the_api(
    start_sim, start_gateway, tmp_path: Path, api: Api
) -> None:
    sim = start_sim("--time-scale", "0")
    gateway = start_gateway([sim.url])
    out = tmp_path / "report.json"
    args = [
        "swe-lite", "--endpoint", gateway.url, "--engine", sim.url, "--compare", "--api", api.value,
        "--concurrency", "2", "--programs", "2", "--slices", "1", "--scale", "0.02", "--time-scale", "0",
        "--warmup", "0", "--out", str(out), "--plot", str(tmp_path / "plot.png"),
    ]  # fmt: skip

    run = CliRunner(env={"COLUMNS": "200"}).invoke(bench_app, args)

    assert run.exit_code == 0, run.output
    report = json.loads(out.read_text())
    assert report["parameters"]["api"] == api.value
    for arm in report["arms"].values():
        assert arm["steps_ok"] > 0 and arm["steps_failed"] == 0
    assert report["arms"]["cluster"]["programs_released"] == 2
    assert f"over the {api.value} API" in run.output and f"API {api.value}" in run.output
    assert gateway.programs() == {}
