"""`thunderctl engine sim` over real HTTP: vLLM's API, its metrics as the gateway reads them, its errors."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from support import SMALL_SIM
from thunderctl.engines.simulated.process import SIM_MODULE, SimProcess
from thunderctl.engines.vllm import EngineMetrics, parse_metrics
from thunderctl.processes import poll_until
from thunderctl.sim.presets import CPU_TINY_COST

WORDS = [f"w{i}" for i in range(400)]


def metrics(url: str) -> EngineMetrics:
    return parse_metrics(httpx.get(f"{url}/metrics").text)


def complete(url: str, prompt: str | list[int], max_tokens: int = 1, timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra},
        timeout=timeout,
    )


def chat(url: str, messages: list[dict], max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def sse_events(response_lines: list[str]) -> list[dict | str]:
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in response_lines
        if line.startswith("data: ")
    ]


def stream_chat(url: str, messages: list[dict], max_tokens: int, include_usage: bool) -> tuple[list, list[float]]:
    """The stream's events, and when each arrived."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events, arrivals = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += sse_events([line])
                arrivals.append(time.monotonic())
    return events, arrivals


def test_the_gateway_reads_the_cache_shape_and_counters_as_from_vllm(start_sim) -> None:
    sim = start_sim(*SMALL_SIM)
    before = metrics(sim.url)
    assert before.kv_capacity_tokens == 64 * 16
    assert (before.requests_running, before.requests_waiting, before.preemptions) == (0, 0, 0)
    assert list(before.per_engine) == ["0"]
    models = httpx.get(f"{sim.url}/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 1024)]


def test_the_same_text_prefix_hits_the_same_cached_blocks(start_sim) -> None:
    sim = start_sim(*SMALL_SIM)
    assert complete(sim.url, " ".join(WORDS[:200])).status_code == 200  # 12 full blocks computed and cached
    first = metrics(sim.url)
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (200, 0)
    assert complete(sim.url, " ".join(WORDS[:250])).status_code == 200
    second = metrics(sim.url)
    assert second.prefix_cache_queries - first.prefix_cache_queries == 250
    assert second.prefix_cache_hits - first.prefix_cache_hits == 192
    assert complete(sim.url, " ".join(["other", *WORDS[1:250]])).status_code == 200  # another first word: no prefix
    assert metrics(sim.url).prefix_cache_hits == second.prefix_cache_hits


def test_an_agents_next_turn_hits_its_previous_prompt_and_answer(start_sim) -> None:
    sim = start_sim(*SMALL_SIM)
    history = [{"role": "system", "content": " ".join(WORDS[:100])}, {"role": "user", "content": "fix the bug"}]
    turn = chat(sim.url, history, max_tokens=30).json()
    answer, prompt_tokens = turn["choices"][0]["message"]["content"], turn["usage"]["prompt_tokens"]
    assert turn["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 30,
        "completion_tokens": 30,
        "prompt_tokens_details": None,
    }
    assert len(answer.split()) == 30 and turn["choices"][0]["finish_reason"] == "length"
    tokenized = httpx.post(f"{sim.url}/tokenize", json={"model": "tiny", "messages": history}).json()
    assert tokenized["count"] == prompt_tokens
    before = metrics(sim.url).prefix_cache_hits
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "now run the tests"}]
    assert chat(sim.url, history, max_tokens=5).status_code == 200
    # Every full block of the first turn's prompt and answer (its last token is never computed).
    assert metrics(sim.url).prefix_cache_hits - before == (prompt_tokens + 30 - 1) // 16 * 16


def test_a_stream_gives_the_answer_then_the_usage_chunk_then_done(small_sim: SimProcess) -> None:
    sim = small_sim
    messages = [{"role": "user", "content": "list the files"}]
    whole = chat(sim.url, messages, max_tokens=12).json()
    events, _ = stream_chat(sim.url, messages, max_tokens=12, include_usage=True)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "chat.completion.chunk"
    assert usage_chunk["usage"] == {
        "prompt_tokens": whole["usage"]["prompt_tokens"],
        "completion_tokens": 12,
        "total_tokens": whole["usage"]["total_tokens"],
    }
    content = [e["choices"][0] for e in events[1:-2]]
    assert "".join(c["delta"]["content"] for c in content) == whole["choices"][0]["message"]["content"]
    assert [c["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    plain, _ = stream_chat(sim.url, messages, max_tokens=12, include_usage=False)
    assert all("usage" not in e for e in plain[:-1]) and plain[-1] == "[DONE]"


@pytest.mark.slow
def test_tokens_stream_as_the_engine_steps_produce_them(start_sim) -> None:
    sim = start_sim("--preset", "cpu-tiny", "--time-scale", "15")
    events, arrivals = stream_chat(sim.url, [{"role": "user", "content": "hi"}], max_tokens=6, include_usage=False)
    content = [(e, t) for e, t in zip(events, arrivals) if e != "[DONE]" and e["choices"][0]["delta"].get("content")]
    assert (
        "".join(e["choices"][0]["delta"]["content"] for e, _ in content).split()
        == httpx.post(
            f"{sim.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
            timeout=60,
        )
        .json()["choices"][0]["message"]["content"]
        .split()
    )
    # The 5 decode steps after the first token each last at least the model's fixed cost, times 15.
    assert content[-1][1] - content[0][1] >= 5 * CPU_TINY_COST.base_s * 15 * 0.95
    assert len(content) >= 2  # the answer came in pieces, not at the end


def test_a_stream_interval_sends_the_first_token_alone_then_that_many_a_chunk_as_vllm_does(start_sim) -> None:
    sim = start_sim(*SMALL_SIM, "--stream-interval", "4")
    messages = [{"role": "user", "content": "hi"}]
    events, _ = stream_chat(sim.url, messages, max_tokens=18, include_usage=True)
    pieces = [e["choices"][0]["delta"]["content"] for e in events[1:-2]]
    sizes = [len(piece.split()) for piece in pieces]  # a simulated token is a word
    assert sizes[0] == 1 and all(size >= 4 for size in sizes[1:-1]) and sum(sizes) == 18
    assert "".join(pieces) == chat(sim.url, messages, max_tokens=18).json()["choices"][0]["message"]["content"]
    assert events[-2]["usage"]["completion_tokens"] == 18


def answering(url: str) -> bool:
    """Whether the engine holds a request (running or waiting) or any KV block."""
    now = metrics(url)
    return now.requests_running + now.requests_waiting > 0 or now.kv_usage > 0


def test_a_stream_whose_client_went_away_is_aborted_and_its_blocks_freed(start_sim) -> None:
    sim = start_sim("--preset", "cpu-tiny", "--time-scale", "1")  # 2,000 tokens: minutes at this pace
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")
        assert answering(sim.url)
    assert poll_until(lambda: not answering(sim.url), timeout_s=10)
    assert metrics(sim.url).generation_tokens < 1000  # it stopped short of its answer


@pytest.mark.slow
def test_a_whole_answer_whose_client_went_away_is_aborted_and_its_blocks_freed(start_sim) -> None:
    sim = start_sim("--preset", "cpu-tiny", "--time-scale", "1")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        complete(sim.url, " ".join(WORDS), max_tokens=2000, timeout=1.0)
    assert poll_until(lambda: not answering(sim.url), timeout_s=10)
    assert metrics(sim.url).generation_tokens < 1000  # it stopped short of its answer


@pytest.mark.slow
def test_a_full_cache_queues_and_preempts_and_every_request_still_finishes(start_sim) -> None:
    sim = start_sim(
        "--preset", "cpu-tiny", "--kv-blocks", "8", "--block-size", "16", "--max-model-len", "128", "--time-scale", "1"
    )
    seen: list[EngineMetrics] = []

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def watch() -> None:
                while True:
                    seen.append(parse_metrics((await client.get(f"{sim.url}/metrics")).text))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            answers = await asyncio.gather(
                *(
                    client.post(f"{sim.url}/v1/completions", json={"prompt": [k] * 60, "max_tokens": 60})
                    for k in range(1, 5)
                )
            )
            watcher.cancel()
            return answers

    answers = asyncio.run(run())
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [60] * 4
    assert max(m.requests_running for m in seen) <= 2  # 8 blocks hold two 60-token prompts at most
    assert any(m.requests_waiting >= 2 for m in seen)
    after = metrics(sim.url)
    assert after.preemptions >= 1
    assert (after.requests_running, after.requests_waiting, after.kv_usage) == (0, 0, 0.0)


def test_a_prompt_longer_than_max_model_len_gets_vllms_400(small_sim: SimProcess) -> None:
    sim = small_sim
    response = complete(sim.url, [7] * 1025)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "This model's maximum context length is 1024 tokens. However, your prompt contains 1025 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
            "input prompt.",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    streamed = complete(sim.url, [7] * 1025, stream=True)
    assert streamed.status_code == 400 and "maximum context length is 1024" in streamed.json()["error"]["message"]


def test_max_tokens_is_clamped_to_what_fits_as_vllm_does(small_sim: SimProcess) -> None:
    sim = small_sim
    usage = complete(sim.url, [7] * 1000, max_tokens=100).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1000, 24)
    full = complete(sim.url, [7] * 1024, max_tokens=5)
    assert full.status_code == 400 and full.json()["error"]["message"] == "max_tokens must be at least 1, got 0."


def test_an_unknown_model_and_bad_bodies_get_vllms_errors(small_sim: SimProcess) -> None:
    sim = small_sim
    unknown = httpx.post(f"{sim.url}/v1/chat/completions", json={"model": "gpt-4", "messages": []})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "The model `gpt-4` does not exist. Valid aliases: tiny.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    for body in ({"messages": "hi"}, {"prompt": {"text": "x"}}, {"prompt": "", "max_tokens": 2}):
        path = "chat/completions" if "messages" in body else "completions"
        response = httpx.post(f"{sim.url}/v1/{path}", json=body)
        assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
    garbled = httpx.post(
        f"{sim.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert garbled.status_code == 400 and "not valid JSON" in garbled.json()["error"]["message"]


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        (
            ("--kv-blocks", "4", "--block-size", "16", "--max-model-len", "1000"),
            "--max-model-len 1,000 does not fit a KV cache of 4 blocks of 16 (64 tokens), as vLLM also refuses: lower "
            "--max-model-len or raise --kv-blocks",
        ),
        (
            ("--preset", "h200"),
            "--preset: unknown preset 'h200': choose one of cpu-tiny, h100-tp4-32b, h100x8-tp8-glm46",
        ),
    ],
)
def test_options_it_cannot_start_with_are_named_with_the_fix(options: tuple[str, ...], complaint: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", SIM_MODULE, "--port", "1", *options], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and complaint in " ".join(done.stderr.split())  # as wrapped to the terminal


@pytest.mark.slow
def test_sigterm_with_a_request_in_flight_exits_without_waiting_for_it(start_sim) -> None:
    sim = start_sim("--preset", "cpu-tiny", "--time-scale", "50")
    started = threading.Event()

    def long_request() -> None:
        started.set()
        try:
            complete(sim.url, "a b c", max_tokens=2000)  # ~10 minutes at this time scale
        except httpx.HTTPError:
            pass

    threading.Thread(target=long_request, daemon=True).start()
    started.wait()
    assert poll_until(lambda: metrics(sim.url).requests_running == 1, 10, 0.05)
    sim.process.send_signal(signal.SIGTERM)
    assert sim.process.wait(timeout=15) is not None  # `down` would have had to SIGKILL it after 15 s
